from llmserve.v1 import worker_pb2
from services.router.prefix_index import PrefixIndex, block_hashes, routing_key

A = "a" * 8
B = "b" * 8


def test_block_hashes_are_chained_over_the_prefix():
    first = block_hashes(A + B + A, "", 8)
    assert len(first) == 3
    assert block_hashes(A + B + "c" * 8, "", 8)[:2] == first[:2]
    # Same third block after a different second one: a different prefix, a different hash.
    other = block_hashes(A + A + A, "", 8)
    assert other[0] == first[0] and other[1] != first[1] and other[2] != first[2]


def test_a_partial_last_block_is_left_out_and_salt_isolates():
    assert block_hashes(A + "xyz", "", 8) == block_hashes(A, "", 8)
    assert block_hashes("abc", "", 8) == []
    assert block_hashes(A, "org-1", 8) != block_hashes(A, "org-2", 8)


def test_match_counts_the_leading_run_only():
    index = PrefixIndex(max_blocks=100)
    held = block_hashes(A + B + A, "", 8)
    index.insert("w1", held)
    assert index.match("w1", held) == 3
    assert index.match("w1", block_hashes(A + B + A + B, "", 8)) == 3
    assert index.match("w1", block_hashes(B + B + A, "", 8)) == 0
    assert index.match("w2", held) == 0


def test_lru_bound_evicts_the_oldest_suffixes_first():
    index = PrefixIndex(max_blocks=4)
    old = block_hashes(A * 3, "", 8)          # 3 blocks
    index.insert("w", old)
    new = block_hashes(B * 3, "", 8)
    index.insert("w", new)                    # 6 blocks > 4: two of the old ones go
    assert index.size("w") == 4
    assert index.match("w", new) == 3
    # The old prefix lost its tail, not its head: its first block still matches.
    assert index.match("w", old) == 1


def test_a_limit_caps_one_worker_below_max_blocks():
    index = PrefixIndex(max_blocks=100)
    index.insert("w", block_hashes(A * 6, "", 8))
    index.insert("v", block_hashes(A * 6, "", 8))
    index.set_limit("w", 2)
    assert index.size("w") == 2 and index.size("v") == 6
    assert index.match("w", block_hashes(A * 6, "", 8)) == 2      # the head survives
    index.set_limit("w", 0)                                       # unknown again: max_blocks
    index.insert("w", block_hashes(B * 6, "", 8))
    assert index.size("w") == 8


def test_drop_forgets_a_worker():
    index = PrefixIndex(max_blocks=10)
    index.insert("w", block_hashes(A, "", 8))
    index.drop("w")
    assert index.size("w") == 0 and index.match("w", block_hashes(A, "", 8)) == 0


def test_routing_key_renders_chat_consistently_and_by_role():
    def chat(*messages):
        return worker_pb2.GenerateRequest(chat=worker_pb2.ChatPrompt(
            messages=[worker_pb2.ChatMessage(role=r, content=c) for r, c in messages]))

    one = routing_key(chat(("user", "hi")))
    assert one == routing_key(chat(("user", "hi")))
    assert one != routing_key(chat(("assistant", "hi")))
    assert routing_key(chat(("user", "hi"), ("assistant", "yo"))).startswith(one)
    assert routing_key(worker_pb2.GenerateRequest(text="abc")) == "abc"
    assert routing_key(worker_pb2.GenerateRequest(token_ids=worker_pb2.TokenIdsPrompt(ids=[1, 2]))) == "1,2"
