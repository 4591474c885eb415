"""One processor per API kind: chat/completions (:mod:`.generation`), embeddings, the model
list, and the fixed error of an unknown path; :mod:`.base` holds the interface and the routing
steps they share."""
