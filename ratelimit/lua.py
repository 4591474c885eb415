"""The Redis side of the bucket math: Lua twins of :func:`ratelimit.bucket.decide` and
:func:`ratelimit.bucket.settled_level`.

Each bucket is a hash ``{l: level, t: stamp in microseconds}``. Time is Redis's own ``TIME``,
so every replica shares one clock. Levels cross the Lua boundary as ``%.17g`` strings because
Redis truncates Lua numbers to integers in replies. A concurrency bucket is a sorted set of
lease ids scored by their expiry (ms); a token reservation is remembered in a marker key
(``<bucket>:lease:<id>``, the bucket's hash tag, so the same Cluster slot) holding the tokens
reserved, with the lease TTL.

``DECIDE`` arguments: ``KEYS`` = the distinct bucket keys and marker keys; ``ARGV`` = margin in
ms, the number of hits, lease TTL in ms, then per hit: key index (1-based into KEYS), capacity,
rate (tokens/s), flags (1 = debt, 2 = shadow, 4 = concurrent), hits, marker key index (0:
none), lease id (or empty). Reply: ``[admitted, ok_1, level_1, ok_2, level_2, ...]`` (a
concurrency bucket's level: its free slots). Leases are written only when the request is
admitted.

``SETTLE`` ends admitted requests: ``ARGV`` = margin in ms, the number of items, then per item:
key index, capacity, rate, used tokens (-1: release the lease's slot), marker key index, lease
id. A marker is read and deleted in one step, so a reservation is settled at most once.

``REFUND`` takes back an admitted group's charges when another Cluster slot group denied the
request: ``ARGV`` = margin in ms, the number of hits, then per hit: key index, capacity, rate,
hits, flags, marker key index, lease id. Reply: the number of buckets refunded.

Old and new replicas share Redis during a rolling upgrade, so what the scripts read and write
(the keys above, their values to the ``%.17g`` text, their TTLs) is a wire format:
``tests/integration/test_lua_versions.py`` runs these scripts, the ones released before them
and the two interleaved on the same clock and requires the same replies and state. Redis CPU is
most of a decision's cost at saturation: ``DECIDE`` makes one pass over the hits, parses each
bucket's capacity and rate once, formats the stamp once per script and reuses a stored level's
text in the reply (``python -m bench.lua_redis``). Commands newer than Redis 6.0 (``GETDEL``)
are not used: no version above that is promised.
"""

from __future__ import annotations

import hashlib

_COMMON = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local EPS = 1e-9
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_text = string.format('%.17g', now)
local margin_ms = tonumber(ARGV[1])
local n = tonumber(ARGV[2])

local function load(k, cap, rate)
  local s = redis.call('HMGET', KEYS[k], 'l', 't')
  if not s[1] or not s[2] then return cap end
  local elapsed = math.max(0, now - tonumber(s[2])) / 1000000
  return math.min(cap, tonumber(s[1]) + elapsed * rate)
end

local function store(k, level, cap, rate)
  local text = string.format('%.17g', level)
  redis.call('HSET', KEYS[k], 'l', text, 't', now_text)
  local ttl = margin_ms
  if rate > 0 then ttl = ttl + math.ceil(math.max(0, cap - level) / rate * 1000) end
  redis.call('PEXPIRE', KEYS[k], math.max(1, ttl))
  return text
end
"""

DECIDE = (
    _COMMON
    + """
local ttl_ms = tonumber(ARGV[3])
local now_ms = math.floor(now / 1000)
local base, cap, rate, conc, level = {}, {}, {}, {}, {}
local order, nk = {}, 0
local hk, hflags, hhits, ok = {}, {}, {}, {}
local admitted = 1
for i = 1, n do
  local o = i * 7 - 4
  local k = tonumber(ARGV[o + 1])
  local flags = tonumber(ARGV[o + 4])
  local hits = tonumber(ARGV[o + 5])
  hk[i], hflags[i], hhits[i] = k, flags, hits
  local l = level[k]
  if l == nil then
    local c, r = tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3])
    if flags >= 4 then
      redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now_ms)
      l = c - redis.call('ZCARD', KEYS[k])
      conc[k] = true
    else
      l = load(k, c, r)
    end
    base[k], cap[k], rate[k] = l, c, r
    nk = nk + 1
    order[nk] = k
  end
  local pass
  if flags % 2 == 1 then
    pass = hits > 0 or l > EPS
  else
    pass = l + EPS >= math.max(hits, 1)
  end
  ok[i] = pass
  if pass then
    level[k] = l - hits
  else
    level[k] = l
    if flags % 4 < 2 then admitted = 0 end
  end
end

if admitted == 0 then
  for j = 1, nk do level[order[j]] = base[order[j]] end
  for i = 1, n do
    if hflags[i] % 2 == 1 and hhits[i] > 0 then
      level[hk[i]] = level[hk[i]] - hhits[i]
    end
  end
end

local text = {}
for j = 1, nk do
  local k = order[j]
  if not conc[k] and level[k] ~= base[k] then text[k] = store(k, level[k], cap[k], rate[k]) end
end
if admitted == 1 then
  for i = 1, n do
    if ok[i] then
      local o = i * 7 - 4
      local lease = ARGV[o + 7]
      if lease ~= '' then
        local k = hk[i]
        if conc[k] then
          redis.call('ZADD', KEYS[k], now_ms + ttl_ms, lease)
          redis.call('PEXPIRE', KEYS[k], ttl_ms)
        else
          local m = tonumber(ARGV[o + 6])
          if m > 0 and hhits[i] > 0 then
            redis.call('SET', KEYS[m], string.format('%.17g', hhits[i]), 'PX', ttl_ms)
          end
        end
      end
    end
  end
end

local reply = {admitted}
for i = 1, n do
  local k = hk[i]
  local s = text[k]
  if s == nil then
    s = string.format('%.17g', level[k])
    text[k] = s
  end
  reply[2 * i] = ok[i] and 1 or 0
  reply[2 * i + 1] = s
end
return reply
"""
)

SETTLE = (
    _COMMON
    + """
for i = 1, n do
  local o = 2 + (i - 1) * 6
  local k = tonumber(ARGV[o + 1])
  local c = tonumber(ARGV[o + 2])
  local r = tonumber(ARGV[o + 3])
  local used = tonumber(ARGV[o + 4])
  local m = tonumber(ARGV[o + 5])
  local lease = ARGV[o + 6]
  if used < 0 then
    redis.call('ZREM', KEYS[k], lease)
  elseif m > 0 then
    local reserved = redis.call('GET', KEYS[m])
    if reserved then
      redis.call('DEL', KEYS[m])
      reserved = tonumber(reserved)
      local level = load(k, c, r)
      local new
      if used <= reserved then
        new = math.min(c, level + (reserved - used))
      else
        new = level - (used - reserved)
      end
      if new ~= level then store(k, new, c, r) end
    end
  end
end
return n
"""
)

REFUND = (
    _COMMON
    + """
local done = 0
for i = 1, n do
  local o = 2 + (i - 1) * 7
  local k = tonumber(ARGV[o + 1])
  local c = tonumber(ARGV[o + 2])
  local r = tonumber(ARGV[o + 3])
  local h = tonumber(ARGV[o + 4])
  local flags = tonumber(ARGV[o + 5])
  local m = tonumber(ARGV[o + 6])
  local lease = ARGV[o + 7]
  if math.floor(flags / 4) % 2 == 1 then
    redis.call('ZREM', KEYS[k], lease)
    done = done + 1
  elseif h > 0 then
    store(k, math.min(c, load(k, c, r) + h), c, r)
    if m > 0 then redis.call('DEL', KEYS[m]) end
    done = done + 1
  end
end
return done
"""
)


def sha1(script: str) -> str:
    """The EVALSHA digest of ``script``."""
    return hashlib.sha1(script.encode()).hexdigest()


DECIDE_SHA = sha1(DECIDE)
SETTLE_SHA = sha1(SETTLE)
REFUND_SHA = sha1(REFUND)
