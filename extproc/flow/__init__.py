"""Flow control (docs: Flow control): requests wait in priority bands while every pod of a
pool is busy. :mod:`.queue` is the pure waiting line; :mod:`.control` runs it on the event
loop, released by the picker's room (:mod:`extproc.picker.room`)."""
