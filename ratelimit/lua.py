"""The Redis side of the bucket math: Lua twins of :func:`ratelimit.bucket.decide`.

Each bucket is a hash ``{l: level, t: stamp in microseconds}``. Time is Redis's own ``TIME``,
so every replica shares one clock. Levels cross the Lua boundary as ``%.17g`` strings because
Redis truncates Lua numbers to integers in replies.

``DECIDE`` arguments: ``KEYS`` = the distinct bucket keys; ``ARGV`` = margin in ms, the number
of hits, then per hit: key index (1-based into KEYS), capacity, rate (tokens/s), flags
(1 = debt, 2 = shadow), hits. Reply: ``[admitted, ok_1, level_1, ok_2, level_2, ...]``.

``REFUND`` gives back charges of an admitted group when another Cluster slot group denied
the request: ``ARGV`` = margin in ms, the number of hits, then per hit: key index, capacity,
rate, hits. Reply: the number of buckets refunded.
"""

from __future__ import annotations

import hashlib

_COMMON = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local EPS = 1e-9
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local margin_ms = tonumber(ARGV[1])
local n = tonumber(ARGV[2])

local function load(k, cap, rate)
  local s = redis.call('HMGET', KEYS[k], 'l', 't')
  if not s[1] or not s[2] then return cap end
  local elapsed = math.max(0, now - tonumber(s[2])) / 1000000
  return math.min(cap, tonumber(s[1]) + elapsed * rate)
end

local function store(k, level, cap, rate)
  redis.call('HSET', KEYS[k], 'l', string.format('%.17g', level), 't', string.format('%.17g', now))
  local ttl = margin_ms
  if rate > 0 then ttl = ttl + math.ceil(math.max(0, cap - level) / rate * 1000) end
  redis.call('PEXPIRE', KEYS[k], math.max(1, ttl))
end
"""

DECIDE = (
    _COMMON
    + """
local base, cap, rate = {}, {}, {}
local hk, hcap, hrate, hflags, hhits = {}, {}, {}, {}, {}
for i = 1, n do
  local o = 2 + (i - 1) * 5
  local k = tonumber(ARGV[o + 1])
  hk[i] = k
  hcap[i] = tonumber(ARGV[o + 2])
  hrate[i] = tonumber(ARGV[o + 3])
  hflags[i] = tonumber(ARGV[o + 4])
  hhits[i] = tonumber(ARGV[o + 5])
  if base[k] == nil then
    base[k] = load(k, hcap[i], hrate[i])
    cap[k] = hcap[i]
    rate[k] = hrate[i]
  end
end

local tentative = {}
for k, level in pairs(base) do tentative[k] = level end
local ok = {}
local admitted = 1
for i = 1, n do
  local k = hk[i]
  local level = tentative[k]
  local debt = hflags[i] % 2 == 1
  local shadow = math.floor(hflags[i] / 2) % 2 == 1
  local pass
  if debt then
    pass = hhits[i] > 0 or level > EPS
  else
    pass = level + EPS >= math.max(hhits[i], 1)
  end
  ok[i] = pass
  if pass then
    tentative[k] = level - hhits[i]
  elseif not shadow then
    admitted = 0
  end
end

local final = tentative
if admitted == 0 then
  final = {}
  for k, level in pairs(base) do final[k] = level end
  for i = 1, n do
    if hflags[i] % 2 == 1 and hhits[i] > 0 then
      final[hk[i]] = final[hk[i]] - hhits[i]
    end
  end
end

for k, level in pairs(final) do
  if level ~= base[k] then store(k, level, cap[k], rate[k]) end
end

local reply = {admitted}
for i = 1, n do
  reply[#reply + 1] = ok[i] and 1 or 0
  reply[#reply + 1] = string.format('%.17g', final[hk[i]])
end
return reply
"""
)

REFUND = (
    _COMMON
    + """
local done = 0
for i = 1, n do
  local o = 2 + (i - 1) * 4
  local k = tonumber(ARGV[o + 1])
  local c = tonumber(ARGV[o + 2])
  local r = tonumber(ARGV[o + 3])
  local h = tonumber(ARGV[o + 4])
  if h > 0 then
    store(k, math.min(c, load(k, c, r) + h), c, r)
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
REFUND_SHA = sha1(REFUND)
