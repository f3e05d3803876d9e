-- Token buckets of one request, changed atomically on Redis's clock (see redis_backend.py).
-- KEYS[i]: a bucket, hash {tokens, ts}; a missing bucket is a full one.
-- ARGV[1]: "acquire" | "reconcile"; ARGV[2i], ARGV[2i+1]: bucket i's per_minute and amount.
-- acquire:   refill every bucket; if each holds its amount (the cost), deduct from all, else from none.
--            Returns {allowed 1|0, level_1, ..., level_n}: levels after the decision, as strings
--            (Lua numbers would come back truncated to integers).
-- reconcile: refill, then subtract the amount (a negative one refunds), never above capacity;
--            a bucket may go negative (debt).
-- A stored bucket expires a minute after it would be full again: expiry changes nothing.
local EPSILON = 1e-9          -- float noise, as in decision.py
local TTL_MARGIN_MS = 60000

local mode = ARGV[1]
if mode ~= 'acquire' and mode ~= 'reconcile' then
  return redis.error_reply('token_bucket.lua: unknown mode ' .. tostring(mode))
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local n = #KEYS
local capacity, amount, level = {}, {}, {}

for i = 1, n do
  capacity[i] = tonumber(ARGV[2 * i])
  amount[i] = tonumber(ARGV[2 * i + 1])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  level[i] = capacity[i]
  if state[1] then
    local elapsed = math.max(0, now - tonumber(state[2]))
    level[i] = math.min(capacity[i], tonumber(state[1]) + elapsed * capacity[i] / 60)
  end
end

local allowed = 1
if mode == 'acquire' then
  for i = 1, n do
    if level[i] + EPSILON < amount[i] then allowed = 0 end
  end
end

local reply = {allowed}
for i = 1, n do
  if allowed == 1 then
    level[i] = math.min(capacity[i], level[i] - amount[i])
    local refill_ms = math.ceil((capacity[i] - level[i]) * 60000 / capacity[i])
    redis.call('HSET', KEYS[i], 'tokens', string.format('%.17g', level[i]), 'ts', string.format('%.6f', now))
    redis.call('PEXPIRE', KEYS[i], refill_ms + TTL_MARGIN_MS)
  end
  reply[i + 1] = string.format('%.17g', level[i])
end
return reply
