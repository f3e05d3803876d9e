from collections import Counter

from llmserve.v1 import worker_pb2

from services.router.config import PolicyConfig
from services.router.policy import CacheAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy, make_policy
from services.router.pool import Pool, Worker
from services.router.prefix_index import block_hashes

CONFIG = PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.3, block_chars=8)


def make_pool(n: int = 3) -> Pool:
    pool = Pool("m", max_blocks_per_worker=1000)
    for i in range(n):
        address = f"w{i}:1"
        pool.workers[address] = Worker(address, "m", "static", channel=None, stub=None, healthy=True)
    return pool


def route(policy, pool: Pool, text: str):
    return policy.choose(pool, pool.routable(), block_hashes(text, "", CONFIG.block_chars))


def test_a_growing_conversation_keeps_its_worker():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    turn = "user: tell me about the sea\n"
    first = route(policy, pool, turn)
    assert first.decision == "cache_miss"
    for i in range(5):
        turn += f"assistant: answer {i}\nuser: and then?\n"
        choice = route(policy, pool, turn)
        assert choice.worker is first.worker and choice.decision == "cache_hit"


def test_unrelated_requests_spread_round_robin_on_ties():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    picks = Counter(route(policy, pool, f"{i:04d} unrelated question").worker.address for i in range(30))
    assert picks == Counter({"w0:1": 10, "w1:1": 10, "w2:1": 10})


def test_imbalance_overrides_affinity():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    text = "a long shared conversation prefix"
    holder = route(policy, pool, text).worker
    holder.in_flight = 3                           # 3 - 0 <= 4: affinity beats load
    assert route(policy, pool, text).worker is holder
    holder.in_flight = 10                          # 10 - 0 > 4 and 10 > 1.5 * 0
    overflow = route(policy, pool, text)
    assert overflow.decision == "imbalanced" and overflow.worker is not holder
    # The overflow worker now holds the prefix too; the less loaded holder wins.
    holder.in_flight = 3
    assert route(policy, pool, text).worker is overflow.worker


def test_another_hot_worker_does_not_break_affinity():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    text = "a long shared conversation prefix"
    holder = route(policy, pool, text).worker
    hot = next(w for w in pool.workers.values() if w is not holder)
    hot.in_flight, holder.in_flight = 20, 2        # the pool is imbalanced, the holder is not
    choice = route(policy, pool, text + " and the next turn")
    assert choice.worker is holder and choice.decision == "cache_hit"


def test_a_weak_match_goes_to_the_least_loaded():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    holder = route(policy, pool, "shared00").worker                 # 1 block
    holder.in_flight = 1
    choice = route(policy, pool, "shared00" + "x" * 32)             # 1 of 5 blocks = 0.2 < 0.3
    assert choice.decision == "cache_miss" and choice.worker is not holder


def test_equal_holders_break_ties_by_load():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    hashes = block_hashes("common system prompt", "", 8)
    for w in pool.workers.values():
        pool.prefixes.insert(w.address, hashes)
    busy = list(pool.workers.values())
    busy[0].in_flight, busy[1].in_flight = 2, 2
    assert policy.choose(pool, pool.routable(), hashes).worker is busy[2]


def test_the_reported_load_counts_too():
    pool, policy = make_pool(2), LeastLoadedPolicy()
    first, second = pool.workers.values()
    first.load.running, first.load.waiting = 3, 2     # another router's requests
    second.in_flight = 4
    assert policy.choose(pool, pool.routable(), []).worker is second


def test_round_robin_ignores_prefixes_and_load():
    pool, policy = make_pool(), make_policy(PolicyConfig(name="round_robin"))
    assert isinstance(policy, RoundRobinPolicy)
    list(pool.workers.values())[0].in_flight = 50
    picks = [route(policy, pool, "same prompt").worker.address for _ in range(6)]
    assert picks == ["w0:1", "w1:1", "w2:1"] * 2


def test_only_candidates_are_chosen():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    holder = route(policy, pool, "conversation").worker
    others = [w for w in pool.routable() if w is not holder]
    choice = policy.choose(pool, others, block_hashes("conversation", "", 8))
    assert choice.worker in others


def test_a_worker_missing_a_check_keeps_its_prefixes():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    text = "a conversation long enough"
    holder = route(policy, pool, text).worker
    pool.set_healthy(holder, False)            # busy: the check timed out; its cache is intact
    assert holder not in pool.routable() and pool.prefixes.size(holder.address) > 0
    pool.set_healthy(holder, True)
    assert route(policy, pool, text + " and more").worker is holder


def test_a_restarted_worker_forgets_its_prefixes():
    pool, policy = make_pool(), CacheAwarePolicy(CONFIG)
    holder = route(policy, pool, "a conversation long enough").worker
    pool.observe_load(holder, worker_pb2.LoadReport(prefix_cache_queries=500))
    assert pool.prefixes.size(holder.address) > 0
    pool.observe_load(holder, worker_pb2.LoadReport(prefix_cache_queries=40))   # counters reset
    assert pool.prefixes.size(holder.address) == 0


def test_prefix_memory_is_capped_at_the_reported_kv_cache():
    pool, policy = make_pool(1), CacheAwarePolicy(CONFIG)
    [worker] = pool.workers.values()
    route(policy, pool, "x" * 8 * 10)                                          # 10 blocks
    pool.observe_load(worker, worker_pb2.LoadReport(kv_blocks_total=0))       # unknown: no cap
    assert pool.prefixes.size(worker.address) == 10
    pool.observe_load(worker, worker_pb2.LoadReport(kv_blocks_total=4))
    assert pool.prefixes.size(worker.address) == 4
    route(policy, pool, "y" * 8 * 6)
    assert pool.prefixes.size(worker.address) == 4


def test_the_pool_keeps_the_model_info_while_no_worker_is_healthy():
    pool = make_pool(2)
    assert pool.model_info() == worker_pb2.ModelInfo(name="m")          # nothing reported yet
    info = worker_pb2.ModelInfo(name="m", max_context_length=8192)
    for worker in pool.workers.values():
        worker.model_info = info
    assert pool.model_info() == info
    for worker in pool.workers.values():
        pool.set_healthy(worker, False)                                 # busy workers missed a check
    assert pool.model_info().max_context_length == 8192
