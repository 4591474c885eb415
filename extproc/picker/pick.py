"""The pick: which pod of a pool gets a request, and when a low-priority request is shed.

:func:`choose` is the pure decision (candidates in, :class:`Pick` out, O(pods)); the
:class:`EndpointPicker` holds what it needs between requests: one
:class:`~extproc.picker.state.PoolState` per picker cluster (the scraper writes metrics and
addresses into the same objects), the prefix index, and the clock and random source (injected
for tests). Everything runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import heapq
import ipaddress
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from extproc.picker.prefix import PrefixIndex, block_hashes
from extproc.picker.room import has_room
from extproc.picker.scoring import NO_WORK, PoolContext, Row, Work, saturated, score_rows
from extproc.picker.state import UNREACHABLE_AFTER, Candidate, PoolState
from routing.picker_schema import EndpointPickerSpec, PickerWeights, SaturationSpec
from routing.schema import RoutingConfig
from routing.units import parse_hostport

Priority = Literal["high", "medium", "low"]
Reason = Literal["scored", "prefix", "share", "unknown", "no_endpoints", "saturated"]

FALLBACKS = 2
"""Runners-up named for Envoy's retries: a pod that refuses the connection is retried on the next
best, never on itself."""

TIE_BAND = 0.05
"""Totals this close to the best are a tie, broken by fewer requests open from this replica,
then chance. Between two scrapes every replica (and worker) sees the same metrics: without a
band they would all send to the one pod that scores best by a hair, and equal pods would be
taken in turn by whoever sorts first. Within 5% of a scorer's range, the estimates are not
better than that anyway."""


@dataclass(frozen=True)
class Pick:
    """One decision. ``endpoint`` None: no pod named (``no_endpoints``: let Envoy balance the pool;
    ``saturated``: shed, answer 503 ``server_overloaded``).

    ``reason``: ``scored`` (the scorers' best), ``prefix`` (the winner holds part of the prompt
    and would not have won without the prefix scorer), ``share`` (a pod with room that had less
    than its share of the pool's requests: :data:`SHARE_FLOOR`), ``unknown`` (no pod has fresh metrics:
    picked by what this replica sent and has open), ``no_endpoints``, ``saturated``."""

    endpoint: str | None
    fallbacks: tuple[str, ...] = ()
    reason: Reason = "scored"
    shed: bool = False
    fills: bool = False
    """``room_only`` picks: the pod has no room left after this request, so the moment it ends
    is the moment the pod has room again (flow control then reads its response to its end)."""


NO_ENDPOINTS = Pick(None, (), "no_endpoints", False)
SHED = Pick(None, (), "saturated", True)


SHARE_FLOOR = 0.75
"""While the pool is at least :data:`BUSY_FROM` full, a pod with a free sequence slot whose share
of this replica's recent picks is below this much of its share of the pool's capacity takes the
next request shorter than the pool's typical one (its output budget at most the mean, and
little of its prompt left to prefill there: :data:`SHORT_PROMPT`). Ranking by
:func:`~extproc.picker.scoring.eta` alone leaves a slow pod idle while the fast ones have a slot
or two: best for the request at hand, but the pool then queues at a load it has the capacity
for, and a pod paid for sits idle. Short requests go, because on a slow pod they are the ones
whose answer is still soon."""

BUSY_FROM = 0.5
"""The share of the pool's throughput in use from which :data:`SHARE_FLOOR` applies: each pod's
sequences in use (up to its slots) over its pace, against its slots over its pace. Counting
slots alone would call a pool half idle whose fast pods are full, since the slow pods it
starves hold half its slots."""

SHORT_PROMPT = 1.0
"""A request goes to a pod owed its share only when the prompt tokens that pod would have to
prefill (what its prefix cache does not hold) are at most this share of the pool's mean prompt:
on a slow pod a long prefill is a late first token."""

MIN_PICKS_FOR_SHARE = 50
"""Picks before shares mean anything (the window holds :data:`~extproc.picker.state.SHARE_WINDOW`,
more than this)."""


def below_share(loads: Sequence[float], capacities: Sequence[float], paces: Sequence[float],
                shares: Sequence[float], room: Sequence[bool]) -> list[bool] | None:
    """Which pods are owed requests (:data:`SHARE_FLOOR`): ``loads[i]`` sequences on pod ``i``
    (running, waiting and sent since its scrape), ``capacities[i]`` its sequence slots,
    ``paces[i]`` its seconds per output token, ``shares[i]`` its share of the recent picks,
    ``room[i]`` whether it can start one more now. None while the pool is less busy than
    :data:`BUSY_FROM`."""
    rates = [c / p for c, p in zip(capacities, paces, strict=True)]
    total = sum(rates)
    # How much of the pool's throughput is in use: a slot of a fast pod counts for more.
    used = sum((load if load < c else c) / p
               for load, c, p in zip(loads, capacities, paces, strict=True))
    if total <= 0.0 or used < BUSY_FROM * total:
        return None
    return [free and share < SHARE_FLOOR * rate / total
            for free, share, rate in zip(room, shares, rates, strict=True)]


def choose(candidates: Sequence[Candidate], weights: PickerWeights, saturation: SaturationSpec | None,
           priority: Priority, rng: random.Random, work: Work = NO_WORK,
           backlog_tokens: float = 0.0) -> Pick:
    """The best candidate by total score; ties go to fewer ``in_flight``, then chance.

    Sheds (``saturated``) only a ``low`` request, only when ``saturation`` is set and every
    candidate has fresh metrics over a threshold: an unknown pod may be free, so it is tried.
    High and medium requests always get the best pod. An ``unreachable`` candidate comes after
    every reachable one (:func:`choose_reachable`).
    """
    return choose_reachable([c.address for c in candidates],
                            [(c.metrics, c.sent_since_scrape, c.in_flight, c.prefix_match,
                              c.tpot_s, c.capacity, c.load) for c in candidates],
                            [c.unreachable for c in candidates],
                            weights, saturation, priority, rng, work, backlog_tokens)


def choose_reachable(addresses: Sequence[str], rows: Sequence[Row], unreachable: Sequence[bool],
                     weights: PickerWeights, saturation: SaturationSpec | None,
                     priority: Priority, rng: random.Random, work: Work = NO_WORK,
                     backlog_tokens: float = 0.0, owed: Sequence[bool] | None = None,
                     pace: float | None = None) -> Pick:
    """:func:`choose_rows` among the pods not ``unreachable[i]`` (unreachable, or ejected for
    failing their answers: :meth:`PodState.avoided`); those only fill
    the fallbacks the reachable ones leave free (best first), so Envoy tries them last. Envoy
    tries a named pod whatever its health checks say, so naming a dead pod first costs every
    such request a failed connect (up to the cluster's connect timeout when packets are
    dropped). Shedding looks at the reachable pods only: a dead pod takes nothing. When no pod
    is reachable (or all are), it is :func:`choose_rows` over all of them: the scraper may be
    the one cut off, and Envoy's own fallback still balances by health.
    """
    if not any(unreachable) or all(unreachable):
        return choose_rows(addresses, rows, weights, saturation, priority, rng, work,
                           backlog_tokens, owed, pace)
    up = [i for i, down in enumerate(unreachable) if not down]
    result = choose_rows([addresses[i] for i in up], [rows[i] for i in up], weights, saturation,
                         priority, rng, work, backlog_tokens, None, pace)
    if result.endpoint is None or len(result.fallbacks) >= FALLBACKS:
        return result
    down = [i for i, dead in enumerate(unreachable) if dead]
    last = choose_rows([addresses[i] for i in down], [rows[i] for i in down], weights, None,
                       "high", rng, work, backlog_tokens, None, pace)
    extra = tuple(a for a in (last.endpoint, *last.fallbacks) if a is not None)
    return replace(result, fallbacks=result.fallbacks + extra[:FALLBACKS - len(result.fallbacks)])


def choose_rows(addresses: Sequence[str], rows: Sequence[Row], weights: PickerWeights,
                saturation: SaturationSpec | None, priority: Priority, rng: random.Random,
                work: Work = NO_WORK, backlog_tokens: float = 0.0,
                owed: Sequence[bool] | None = None, pace: float | None = None) -> Pick:
    """:func:`choose` on candidates given as ``addresses[i]`` and ``rows[i]`` (see
    :data:`~extproc.picker.scoring.Row`): what :meth:`EndpointPicker.pick` calls, without a
    :class:`Candidate` per pod."""
    if not rows:
        return NO_ENDPOINTS
    # The pool's best cost only when speed counts: weighted 0, it leaves the headroom alone too.
    ctx = PoolContext.of(saturation, rows, speed=weights.speed > 0.0,
                         latency=weights.latency > 0.0, work=work, backlog_tokens=backlog_tokens,
                         pace=pace)
    if (priority == "low" and saturation is not None
            and all(row[0] is not None and saturated(row[0], ctx) for row in rows)):
        return SHED
    # (total, -in_flight, chance, total without prefix, index): tuples compare in that order, so
    # the best is the highest total (those within TIE_BAND of the best count as it), then the
    # fewest open, then chance. The index is unique, so comparison never gets past it.
    totals, bases = score_rows(rows, weights, ctx)
    tie = max(totals) - TIE_BAND
    chance = rng.random
    ranked = list(zip([t if t < tie else tie for t in totals], [-row[2] for row in rows],
                      [chance() for _ in rows], bases, range(len(rows)), strict=True))
    top = heapq.nlargest(1 + FALLBACKS, ranked)
    if owed is not None and any(owed):
        # The best pod that is owed requests goes first; the best of the rest back it up.
        first = max(entry for entry in ranked if owed[entry[4]])
        rest = [entry for entry in top if entry is not first]
        return Pick(addresses[first[4]],
                    tuple(addresses[entry[4]] for entry in rest[:FALLBACKS]), "share")
    winner = top[0]
    endpoint = addresses[winner[4]]
    fallbacks = tuple(addresses[entry[4]] for entry in top[1:])
    if all(row[0] is None for row in rows):
        return Pick(endpoint, fallbacks, "unknown")
    if rows[winner[4]][3] > 0.0 and _prefix_decided(winner, ranked):
        return Pick(endpoint, fallbacks, "prefix")
    return Pick(endpoint, fallbacks, "scored")


_Ranked = tuple[float, int, float, float, int]


def _prefix_decided(winner: _Ranked, ranked: list[_Ranked]) -> bool:
    """Whether, without the prefix scorer, another pod would rank at least as high (a tie would
    have been chance, so the prefix still decided it)."""
    mine = (winner[3], winner[1])
    return any((entry[3], entry[1]) >= mine for entry in ranked if entry is not winner)


def kv_full(saturation: SaturationSpec | None) -> float:
    """The KV-cache use at which a pod of the pool has no room (``saturation.kv_cache``)."""
    return (saturation or SaturationSpec()).kv_cache


def _medians(pool: PoolState, declared: float | None) -> tuple[float | None, float | None]:
    """The pool's median pace and capacity (:meth:`PoolState.medians`), the capacity being the
    ``declared`` one (:attr:`~routing.schema.ClusterSpec.declared_seqs`) until some pod of the
    pool is seen full."""
    pace, slots = pool.medians()
    return pace, (declared if slots is None else slots)


def reachable_rooms(rooms: Sequence[bool], down: Sequence[bool]) -> list[bool]:
    """``rooms`` without the pods that are ``down`` (unreachable or ejected), unless every pod
    is: the scraper may be the one cut off."""
    if any(down) and not all(down):
        return [room and not dead for room, dead in zip(rooms, down, strict=True)]
    return list(rooms)


def _is_ip_literal(endpoint: str) -> bool:
    try:
        ipaddress.ip_address(parse_hostport(endpoint)[0])
    except ValueError:
        return False
    return True


def _literals(endpoints: Sequence[str]) -> list[str]:
    """The endpoints that are ``ip:port`` (IPv6 as ``[::1]:80``), as written: Envoy names a host
    the same way. DNS names wait for the scraper's resolution."""
    return [e for e in endpoints if _is_ip_literal(e)]


class EndpointPicker:
    """The picker of every ``endpoint_picker`` cluster of one routing config.

    ``pools`` maps each such cluster to its :class:`PoolState`; the scraper writes into these
    objects (``set_addresses``, ``record_scrape``, ``record_failure``) and :meth:`update` keeps
    them for clusters that stay, so a reload loses no pod state. ``clock`` must be the clock the
    scraper stamps scrapes with (the event loop's ``time``: monotonic seconds).
    """

    def __init__(self, config: RoutingConfig, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, index: PrefixIndex | None = None) -> None:
        self.pools: dict[str, PoolState] = {}
        self._specs: dict[str, EndpointPickerSpec] = {}
        self._endpoints: dict[str, list[str]] = {}
        self._declared: dict[str, float | None] = {}
        """Each picker cluster's :attr:`~routing.schema.ClusterSpec.declared_seqs`."""
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        # One index for every cluster (its entries are per cluster), kept across reloads.
        self.index = index if index is not None else PrefixIndex()  # an empty index is falsy
        self.update(config)

    def update(self, config: RoutingConfig) -> None:
        """Adopt a reloaded config: pools for the picker clusters it names, the state of pods
        that remain kept; clusters that lost ``endpoint_picker`` (or are gone) are dropped."""
        pools: dict[str, PoolState] = {}
        specs: dict[str, EndpointPickerSpec] = {}
        endpoints: dict[str, list[str]] = {}
        declared: dict[str, float | None] = {}
        for name, cluster in config.clusters.items():
            spec = cluster.endpoint_picker
            if spec is None:
                continue
            specs[name], endpoints[name] = spec, list(cluster.endpoints)
            seqs = cluster.declared_seqs
            declared[name] = float(seqs) if seqs is not None else None
            pool = self.pools.get(name)
            if pool is None:
                pool = PoolState(name, spec.stale_s)
                pool.set_addresses(_literals(cluster.endpoints))
            else:
                pool.stale_s = spec.stale_s
                if self._endpoints.get(name) != endpoints[name]:
                    pool.set_addresses(self._carried(pool, self._endpoints.get(name, []),
                                                     cluster.endpoints))
            pools[name] = pool
        # In place: the scraper and the metrics hold this same dict.
        self.pools.clear()
        self.pools.update(pools)
        self._specs, self._endpoints, self._declared = specs, endpoints, declared

    @staticmethod
    def _carried(pool: PoolState, old: Sequence[str], new: Sequence[str]) -> list[str]:
        """The addresses a pool keeps when its YAML endpoints change: the new IP literals, and,
        while the new list still has DNS names, the pods resolved from the old names (the
        scraper's next resolution corrects them; dropping them now would leave a DNS-only pool
        empty until then)."""
        keep = _literals(new)
        if len(keep) < len(new):
            gone = set(_literals(old))
            keep += [a for a in pool.pods if a not in gone and a not in keep]
        return keep

    def rooms(self, cluster: str) -> list[bool] | None:
        """Which pods of ``cluster`` can start one more request now
        (:func:`~extproc.picker.room.has_room`), in pool order; a pod that is unreachable or
        ejected has none, unless every pod is (the scraper may be the one cut off). None: the
        cluster has no picker."""
        pool = self.pools.get(cluster)
        if pool is None:
            return None
        spec = self._specs[cluster]
        full = kv_full(spec.saturation)
        now = self._clock()
        declared = self._declared[cluster]
        _, slots = _medians(pool, declared)
        rooms: list[bool] = []
        down: list[bool] = []
        for pod in pool.pods.values():
            rooms.append(has_room(pod, pool.fresh(pod, now), slots, full, declared))
            down.append(pod.avoided(now))
        return reachable_rooms(rooms, down)

    def has_room(self, cluster: str) -> bool:
        """Can some pod of ``cluster`` start one more request now? True for a pool without a
        picker or without pods: nothing to wait for there, Envoy balances it."""
        rooms = self.rooms(cluster)
        return not rooms or any(rooms)

    def pick(self, cluster: str, prompt: bytes, priority: Priority,
             salt: str | None = None, work: Work = NO_WORK,
             room_only: bool = False) -> Pick | None:
        """The pod for one request of ``cluster`` (None: the cluster has no picker). A named pod
        is counted as sent (and open until :meth:`done`) and remembered for the prompt's prefix.
        ``prompt`` is the text the model will see first to last (what vLLM's prefix cache keys
        on), not the JSON body, whose leading fields differ between identical prompts; ``salt``
        its ``cache_salt`` (a prefix is matched only among prompts of the same salt); ``work``
        its prompt and output tokens (what `latency` estimates with). ``room_only`` (flow
        control): only a pod with room (:meth:`rooms`) is named first, the others back it up,
        and nothing is shed."""
        pool = self.pools.get(cluster)
        if pool is None:
            return None
        spec = self._specs[cluster]
        now = self._clock()
        blocks = block_hashes(prompt, salt=salt)
        matches = self.index.match(cluster, blocks) if blocks else {}
        addresses = list(pool.pods)
        rows: list[Row] = []
        avoided: list[bool] = []
        rooms: list[bool] = []
        full = kv_full(spec.saturation)
        # PoolState.fresh and PodState.avoided inlined: this runs over every pod. The load is
        # Candidate.load: the other replicas' at the scrape plus this one's open requests now.
        stale = now - pool.stale_s
        declared = self._declared[cluster]
        pace, slots = _medians(pool, declared)
        for address, pod in pool.pods.items():
            scraped, metrics = pod.scraped_at, pod.metrics
            load = None
            if scraped is None or scraped < stale or metrics is None:
                metrics = None
            else:
                others = metrics.running + metrics.waiting - pod.open_at_scrape
                load = (others if others > 0.0 else 0.0) + pod.in_flight
            rows.append((metrics, pod.sent_since_scrape, pod.in_flight, matches.get(address, 0.0),
                         pod.tpot_s, pod.capacity_estimate(slots, metrics), load))
            avoided.append(pod.connect_failures >= UNREACHABLE_AFTER or now < pod.ejected_until)
            if room_only:  # :meth:`rooms`, in this same pass
                rooms.append(has_room(pod, metrics, slots, full, declared))
        if room_only:
            rooms = reachable_rooms(rooms, avoided)
            if any(rooms):
                avoided = [not room for room in rooms]
            priority = "high"  # a flow-controlled pool waits instead of shedding
        if work.prompt_tokens <= 0:  # what extproc's estimate counts: 4 bytes a token
            work = Work(len(prompt) // 4, work.output_tokens)
        owed = None
        if (spec.weights.latency > 0.0 and 0 < work.output_tokens <= pool.backlog_tokens
                and len(pool.window) >= MIN_PICKS_FOR_SHARE and not any(avoided)):
            owed = self._owed(pool, rows, spec.saturation, declared)
            if owed is not None:  # and only where its prompt is mostly cached, or short
                light = SHORT_PROMPT * pool.prompt_mean
                owed = [o and (1.0 - min(1.0, row[3])) * work.prompt_tokens <= light
                        for o, row in zip(owed, rows, strict=True)]
        pool.note(work.prompt_tokens, work.output_tokens)
        result = choose_reachable(addresses, rows, avoided, spec.weights, spec.saturation,
                                  priority, self._rng, work, pool.backlog_tokens, owed,
                                  pace or 1.0)
        if result.endpoint is not None:
            if blocks:
                self.index.record(cluster, blocks, result.endpoint)
            pool.sent(result.endpoint)
            if room_only:
                fresh = rows[addresses.index(result.endpoint)][0]
                if not has_room(pool.pods[result.endpoint], fresh, slots, full, declared):
                    result = replace(result, fills=True)
        return result

    @staticmethod
    def _owed(pool: PoolState, rows: Sequence[Row], saturation: SaturationSpec | None,
              declared: float | None) -> list[bool] | None:
        """:func:`below_share` of the pool's pods; None unless every pod has fresh metrics and
        some pod's pace and capacity were measured. A pod idle so far has neither: it is taken
        to be like the pool's median pod, the pods of one pool being alike until seen not to
        be."""
        full = kv_full(saturation)
        pace, slots = _medians(pool, declared)
        if pace is None or slots is None:
            return None
        loads: list[float] = []
        capacities: list[float] = []
        paces: list[float] = []
        room: list[bool] = []
        shares: list[float] = []
        window = len(pool.window)
        for (metrics, _, _, _, tpot, capacity, load), pod in zip(rows, pool.pods.values(), strict=True):
            if metrics is None or load is None or capacity is None:
                return None
            used = metrics.kv_usage
            loads.append(load)
            capacities.append(capacity)
            paces.append(tpot if tpot is not None and tpot > 0.0 else pace)
            room.append(load < capacity and (used is None or used < full))
            shares.append(pod.recent / window)
        return below_share(loads, capacities, paces, shares, room)

    def done(self, cluster: str, address: str, unread: bool = False) -> None:
        """A request :meth:`pick` sent to ``address`` ended (answered, failed or aborted);
        ``unread``: extproc did not read its response (:meth:`PoolState.done`)."""
        pool = self.pools.get(cluster)
        if pool is not None:
            pool.done(address, unread)

    def answered(self, cluster: str, address: str, status: int) -> bool:
        """The pod ``address``, picked for a request, itself answered it with ``status`` (Envoy's
        local replies are not told). True: the pod is now ejected
        (:meth:`PoolState.record_answer`)."""
        pool = self.pools.get(cluster)
        if pool is None:
            return False
        return pool.record_answer(address, status >= 500, self._clock())
