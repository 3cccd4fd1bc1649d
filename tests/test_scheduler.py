"""The scheduler on its own (no backend): admission (max_running, KV budget, FCFS), chunked
prefill within the token budget, decode rows first, preemption of the newest sequence."""

from __future__ import annotations

from swiftlm.sampling import SamplerState, SamplingParams
from swiftlm.scheduler import Scheduler, Sequence


def _seq(i: int, prompt_len: int = 4, out: list[int] | None = None, media=None) -> Sequence:
    prompt = list(range(100 * i, 100 * i + prompt_len))
    s = Sequence(i, prompt, SamplingParams(), SamplerState(seed=i), media=media)
    if out:
        s.output_tokens = list(out)
    return s


def _rows(batch):
    return [(w.seq_id, w.tokens, w.start_pos, w.sample) for w in batch.seqs]


def test_sequence_token_ranges():
    s = Sequence(1, [1, 2, 3], SamplingParams(), SamplerState(seed=0), output_tokens=[4, 5])
    assert s.all_tokens == [1, 2, 3, 4, 5]
    assert s.tokens(0) == [1, 2, 3, 4, 5]
    assert s.tokens(1, 2) == [2]
    assert s.tokens(0, 3) == [1, 2, 3]
    assert s.tokens(2, 4) == [3, 4]
    assert s.tokens(3) == [4, 5]
    assert s.tokens(4) == [5]
    assert s.tokens(3, 4) == [4]
    assert s.tokens(1, 5) == [2, 3, 4, 5]
    assert s.kv_demand == 6
    assert (s.num_computed, s.cancelled, s.preemptions, s.media) == (0, False, 0, None)


def test_prefill_target_and_in_prefill():
    s = _seq(1, prompt_len=3)
    assert s.prefill_target == 3 and s.in_prefill
    s.output_tokens = [7]
    assert s.prefill_target == 3  # the only generated token is fed by the decode row
    s.output_tokens = [7, 8, 9]
    assert s.prefill_target == 5
    s.num_computed = 4
    assert s.in_prefill
    s.num_computed = 5
    assert not s.in_prefill
    assert Sequence(2, [], SamplingParams(), SamplerState(seed=0)).output_tokens == []


def test_constructor_defaults_and_clamps():
    s = Scheduler()
    assert (s.max_running, s.prefill_size, s.kv_budget, s.preemptions) == (1, 512, None, 0)
    assert s.token_budget == 513
    s = Scheduler(max_running=0, prefill_size=0, kv_budget_tokens=0)
    assert (s.max_running, s.prefill_size, s.kv_budget) == (1, 1, None)
    assert s.token_budget == 2
    assert Scheduler(max_running=8, prefill_size=4).token_budget == 16
    assert Scheduler(max_running=3, prefill_size=10).token_budget == 13
    assert Scheduler(max_running=3, prefill_size=10, token_budget=7).token_budget == 7
    assert Scheduler(kv_budget_tokens=100).kv_budget == 100
    # a budget below the decode rows plus one prompt token is raised: a prompt could wait forever
    assert Scheduler(max_running=4, token_budget=2).token_budget == 5


def test_a_large_token_budget_prefills_a_wave_of_prompts_in_one_step():
    """--max-batched-tokens: 16 prompts of 40 tokens arrive together.  The default budget
    (max(512, 16) + 16 = 528) prefills 13 whole prompts in the first step (the 14th, which one chunk
    holds, is not split at the budget's edge) and the other 3 beside the 13 new decode rows in a
    second; a budget of 4096 takes the whole wave in one step."""
    for budget, want in ((None, [520, 13 + 120]), (4096, [640])):
        s = Scheduler(max_running=16, prefill_size=512, token_budget=budget)
        seqs = {i: _seq(i, prompt_len=40) for i in range(1, 17)}
        for q in seqs.values():
            s.add(q)
        per_step = []
        while any(q.in_prefill for q in seqs.values()):
            b = s.schedule()
            per_step.append(sum(len(w.tokens) for w in b.seqs))
            for w in b.seqs:
                q = seqs[w.seq_id]
                q.num_computed += len(w.tokens)
                if w.sample:
                    q.output_tokens.append(7)
        assert per_step == want, budget


def test_add_remove_has_work_kv_in_use():
    s = Scheduler(max_running=1)
    assert not s.has_work() and s.kv_in_use() == 0
    a, b, c = _seq(1), _seq(2), _seq(3)
    s.add(a)
    s.add(b)
    assert s.has_work() and list(s.waiting) == [a, b]
    s.schedule()
    assert s.running == [a] and list(s.waiting) == [b]
    a.num_computed = 4
    assert s.kv_in_use() == 4
    s.remove(b)
    assert list(s.waiting) == [] and s.running == [a]
    s.remove(c)  # neither running nor waiting: nothing happens
    s.remove(a)
    assert s.running == [] and not s.has_work()


def test_prefill_in_chunks_then_decode():
    s = Scheduler(max_running=1, prefill_size=3, token_budget=10)
    a = _seq(1, prompt_len=7)
    s.add(a)
    b = s.schedule()
    assert _rows(b) == [(1, [100, 101, 102], 0, False)] and b.preempted == []
    assert b.seqs[0].params is a.params and b.seqs[0].state is a.state and b.seqs[0].media is None
    a.num_computed = 3
    assert _rows(s.schedule()) == [(1, [103, 104, 105], 3, False)]
    a.num_computed = 6
    assert _rows(s.schedule()) == [(1, [106], 6, True)]  # the last chunk samples
    a.num_computed = 7
    a.output_tokens = [9]
    b = s.schedule()
    assert _rows(b) == [(1, [9], 7, True)]
    assert b.seqs[0].params is a.params and b.seqs[0].state is a.state


def test_decode_rows_first_and_prefill_within_the_budget():
    s = Scheduler(max_running=3, prefill_size=8, token_budget=6)
    a, b, c = _seq(1, prompt_len=2), _seq(2, prompt_len=5), _seq(3, prompt_len=5)
    for q in (a, b, c):
        s.add(q)
    a.num_computed, a.output_tokens = 2, [50]
    # a decodes (1 token), then b gets min(prefill_size, budget left 5, 5) = 5, c gets nothing this step
    assert _rows(s.schedule()) == [(1, [50], 2, True), (2, [200, 201, 202, 203, 204], 0, True)]
    b.num_computed, b.output_tokens = 5, [60]
    # two decode rows, then c's prefill in the 4 tokens left
    assert _rows(s.schedule()) == [(1, [50], 2, True), (2, [60], 5, True), (3, [300, 301, 302, 303], 0, False)]


def test_budget_exactly_used_leaves_no_empty_chunk():
    s = Scheduler(max_running=2, prefill_size=4, token_budget=4)
    a, b = _seq(1, prompt_len=4), _seq(2, prompt_len=4)
    s.add(a)
    s.add(b)
    assert _rows(s.schedule()) == [(1, [100, 101, 102, 103], 0, True)]  # no zero-length chunk for b
    a.num_computed, a.output_tokens = 4, [1]
    assert _rows(s.schedule()) == [(1, [1], 4, True), (2, [200, 201, 202], 0, False)]


def test_max_running_limits_admission():
    s = Scheduler(max_running=2, prefill_size=1, token_budget=100)
    seqs = [_seq(i) for i in range(1, 5)]
    for q in seqs:
        s.add(q)
    b = s.schedule()
    assert [w.seq_id for w in b.seqs] == [1, 2] and s.running == seqs[:2] and list(s.waiting) == seqs[2:]
    s.remove(seqs[0])
    s.schedule()
    assert s.running == [seqs[1], seqs[2]]


def test_kv_budget_admission_is_fcfs():
    s = Scheduler(max_running=4, prefill_size=64, token_budget=100, kv_budget_tokens=12)
    a, big, small = _seq(1, prompt_len=5), _seq(2, prompt_len=7), _seq(3, prompt_len=1)
    for q in (a, big, small):
        s.add(q)
    batch = s.schedule()
    assert batch.preempted == [] and s.preemptions == 0 and [w.seq_id for w in batch.seqs] == [1]
    # a needs 6 KV positions; big would need 8 more (14 > 12): it waits, and small may not overtake it
    assert s.running == [a] and list(s.waiting) == [big, small]
    s.remove(a)
    s.schedule()
    assert s.running == [big, small]  # 8 + 2 = 10 <= 12


def test_a_blocked_head_still_lets_the_running_ones_step():
    s = Scheduler(max_running=4, prefill_size=64, token_budget=100, kv_budget_tokens=10)
    a, b = _seq(1, prompt_len=5), _seq(2, prompt_len=5)
    s.add(a)
    s.schedule()
    a.num_computed, a.output_tokens = 5, [7]
    s.add(b)
    batch = s.schedule()  # b (6) does not fit beside a (7): a decodes alone
    assert _rows(batch) == [(1, [7], 5, True)] and list(s.waiting) == [b]


def test_a_sequence_preempted_twice_counts_twice():
    s = Scheduler(max_running=2, prefill_size=64, token_budget=100, kv_budget_tokens=12)
    a, b = _seq(1, prompt_len=5), _seq(2, prompt_len=5)
    for q in (a, b):
        s.add(q)
    s.schedule()
    for _ in range(2):
        b.output_tokens = [1, 2]  # 6 + 8 > 12: b goes back
        s.schedule()
        assert s.running == [a] and list(s.waiting) == [b]
        b.output_tokens = []
        s.remove(a)
        s.add(a)
        s.waiting.rotate(1)  # a first again, then b
        s.schedule()
        assert s.running == [a, b]
    assert (b.preemptions, s.preemptions) == (2, 2)


def test_a_one_token_budget_remainder_is_used():
    s = Scheduler(max_running=2, prefill_size=8, token_budget=3)  # the smallest budget for 2 rows
    a, b, c = _seq(1, prompt_len=2), _seq(2, prompt_len=2), _seq(3, prompt_len=3)
    for q in (a, b, c):
        s.add(q)
    s.max_running = 3  # a third sequence admitted: two decode rows leave one token of the budget
    a.num_computed, a.output_tokens = 2, [5]
    b.num_computed, b.output_tokens = 2, [6]
    assert _rows(s.schedule()) == [(1, [5], 2, True), (2, [6], 2, True), (3, [300], 0, False)]


def test_kv_budget_admits_an_exact_fit():
    s = Scheduler(max_running=4, prefill_size=64, token_budget=100, kv_budget_tokens=12)
    a, b = _seq(1, prompt_len=5), _seq(2, prompt_len=5)  # 6 + 6 == 12
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert s.running == [a, b] and s.preemptions == 0 and batch.preempted == []


def test_a_single_sequence_is_admitted_and_never_preempted_over_budget():
    s = Scheduler(max_running=2, prefill_size=64, token_budget=100, kv_budget_tokens=4)
    a = _seq(1, prompt_len=10)
    s.add(a)
    b = s.schedule()
    assert s.running == [a] and b.preempted == [] and s.preemptions == 0
    assert _rows(b) == [(1, list(range(100, 110)), 0, True)]


def test_preemption_drops_the_newest_and_requeues_it_first():
    s = Scheduler(max_running=3, prefill_size=64, token_budget=100, kv_budget_tokens=20)
    a, b, c = _seq(1, prompt_len=5), _seq(2, prompt_len=5), _seq(3, prompt_len=5)
    for q in (a, b, c):
        s.add(q)
    s.schedule()
    assert s.running == [a, b, c]  # 6 + 6 + 6 = 18 <= 20
    for q in (a, b, c):
        q.num_computed, q.output_tokens = 6, [1, 2]  # each now needs 8: 24 > 20
    d = _seq(4)
    s.add(d)
    batch = s.schedule()
    assert batch.preempted == [3]
    assert s.running == [a, b] and list(s.waiting) == [c, d]
    assert (c.num_computed, c.preemptions, s.preemptions) == (0, 1, 1)
    assert (a.preemptions, b.preemptions) == (0, 0)
    # the survivors decode; the preempted one is not in this step
    assert _rows(batch) == [(1, [2], 6, True), (2, [2], 6, True)]


def test_preemption_of_several_in_one_step():
    s = Scheduler(max_running=3, prefill_size=64, token_budget=100, kv_budget_tokens=30)
    seqs = [_seq(i, prompt_len=5) for i in (1, 2, 3)]
    for q in seqs:
        s.add(q)
    s.schedule()
    for q in seqs:
        q.num_computed, q.output_tokens = 5, list(range(10))  # 16 each
    batch = s.schedule()
    assert batch.preempted == [3, 2] and s.running == seqs[:1] and list(s.waiting) == [seqs[1], seqs[2]]
    assert s.preemptions == 2


def test_resumed_sequence_recomputes_without_sampling():
    s = Scheduler(max_running=1, prefill_size=4, token_budget=10)
    a = _seq(1, prompt_len=3, out=[7, 8, 9])  # preempted after three tokens: recompute 5 positions
    s.add(a)
    assert _rows(s.schedule()) == [(1, [100, 101, 102, 7], 0, False)]
    a.num_computed = 4
    assert _rows(s.schedule()) == [(1, [8], 4, False)]  # the end of the prefill: still no sample
    a.num_computed = 5
    assert _rows(s.schedule()) == [(1, [9], 5, True)]  # the decode row samples the next token


def test_media_prompt_is_prefilled_in_one_chunk():
    media = object()
    s = Scheduler(max_running=2, prefill_size=2, token_budget=3)
    a = _seq(1, prompt_len=6, media=media)
    s.add(a)
    b = s.schedule()
    assert _rows(b) == [(1, list(range(100, 106)), 0, True)] and b.seqs[0].media is media
    a.num_computed, a.output_tokens = 6, [5]
    b = s.schedule()
    assert _rows(b) == [(1, [5], 6, True)] and b.seqs[0].media is None


def test_media_only_on_the_first_chunk():
    media = object()
    s = Scheduler(max_running=1, prefill_size=2, token_budget=3)
    a = _seq(1, prompt_len=6, media=media)
    a.num_computed = 2  # (a prefill already under way: the media went with the first chunk)
    s.add(a)
    b = s.schedule()
    assert _rows(b) == [(1, [102, 103], 2, False)] and b.seqs[0].media is None


def test_a_prompt_one_chunk_holds_is_not_split_at_the_budget_edge():
    """Beside other prompt chunks, a prompt whose rest fits one chunk (<= prefill_size) but not the
    step's remaining budget waits for the next step, whole (where it is scheduled first), while a
    shorter prompt behind it may fill the budget; a longer prompt is split when at least half a chunk
    is left, and a step's first chunk always takes what the budget allows (progress)."""

    def step(s, seqs):
        b = s.schedule()
        for w in b.seqs:
            q = seqs[w.seq_id]
            q.num_computed += len(w.tokens)
            if w.sample:
                q.output_tokens.append(7)
        return [(w.seq_id, w.start_pos, len(w.tokens)) for w in b.seqs]

    s = Scheduler(max_running=4, prefill_size=8, token_budget=10)
    seqs = {1: _seq(1, 6), 2: _seq(2, 6), 3: _seq(3, 3)}
    for q in seqs.values():
        s.add(q)
    assert step(s, seqs) == [(1, 0, 6), (3, 0, 3)]  # 2 (6 > 4 left) waits; 3 fits behind it
    assert step(s, seqs) == [(1, 6, 1), (3, 3, 1), (2, 0, 6)]

    s = Scheduler(max_running=4, prefill_size=8, token_budget=10)
    seqs = {1: _seq(1, 6), 2: _seq(2, 20)}
    for q in seqs.values():
        s.add(q)
    assert step(s, seqs) == [(1, 0, 6), (2, 0, 4)]  # 20 > prefill_size: split, 4 left is half a chunk
    assert step(s, seqs) == [(1, 6, 1), (2, 4, 8)]

    s = Scheduler(max_running=4, prefill_size=8, token_budget=10)
    seqs = {1: _seq(1, 7), 2: _seq(2, 20)}
    for q in seqs.values():
        s.add(q)
    assert step(s, seqs) == [(1, 0, 7)]  # 3 left: less than half a chunk of the long prompt, which waits
    assert step(s, seqs) == [(1, 7, 1), (2, 0, 8)]

    s = Scheduler(max_running=1, prefill_size=8, token_budget=4)
    seqs = {1: _seq(1, 6)}
    s.add(seqs[1])
    assert step(s, seqs) == [(1, 0, 4)]  # the step's first chunk: split at the budget
    assert step(s, seqs) == [(1, 4, 2)]


def test_long_prompts_beside_a_prefilling_one_take_no_slivers():
    """Eight long prompts at the default budget (prefill_size + max_running): the oldest takes a full chunk each
    step and the others wait, rather than each step also carrying a few-token slice of the next prompt (a forward
    of its own, and a compressed cache's first chunk too small to hold its prompt in 16 bits).  Every chunk is a
    full one except a prompt's last, and each prompt prefills in its minimum number of steps, one after another."""
    P, N = 64, 8
    s = Scheduler(max_running=N, prefill_size=P)
    seqs = {i: _seq(i, 10 * P) for i in range(1, N + 1)}
    for q in seqs.values():
        s.add(q)
    finished, steps = [], 0
    while len(finished) < N:
        steps += 1
        b = s.schedule()
        chunks = [w for w in b.seqs if seqs[w.seq_id].in_prefill]
        assert len(chunks) == 1 and len(chunks[0].tokens) == P, [(w.seq_id, len(w.tokens)) for w in chunks]
        for w in b.seqs:
            q = seqs[w.seq_id]
            q.num_computed += len(w.tokens)
            if w.sample:
                q.output_tokens.append(7)
                if w.seq_id not in finished and len(q.output_tokens) == 1:
                    finished.append(w.seq_id)
    assert finished == list(range(1, N + 1)) and steps == N * 10


def test_paged_pool_admission_and_preemption_by_blocks():
    """With a block manager the scheduler admits by blocks (less what running sequences still need), grows
    every running table to its next position, and preempts the newest when blocks run out, freeing its
    blocks in the same call."""
    from swiftlm.kv_blocks import KVBlocks
    from swiftlm.sampling import SamplerState, SamplingParams

    blocks = KVBlocks(6, 4)
    sch = Scheduler(max_running=4, prefill_size=64, blocks=blocks)

    def seq(i, n):
        return Sequence(i, list(range(n)), SamplingParams(max_tokens=64), SamplerState())

    a, b, c = seq(1, 7), seq(2, 7), seq(3, 7)  # 8 positions with the next one: 2 blocks each
    for s in (a, b, c):
        sch.add(s)
    batch = sch.schedule()
    assert [w.seq_id for w in batch.seqs] == [1, 2, 3] and blocks.used() == 6 and blocks.available() == 0
    for s in (a, b, c):  # prompts done, first tokens sampled: 9 positions -> 3 blocks each
        s.num_computed = 7
        s.output_tokens.append(0)
    batch = sch.schedule()  # a and b need one more block each: c (the newest) is preempted for them
    assert batch.preempted == [3] and [s.seq_id for s in sch.running] == [1, 2]
    assert len(blocks.table(1)) == len(blocks.table(2)) == 3 and not blocks.has(3) and blocks.available() == 0
    assert sch.preemptions == 1 and [s.seq_id for s in sch.waiting] == [3] and c.num_computed == 0
    blocks.check()
    # c is readmitted (recomputing from position 0) once a's end frees its blocks
    sch.remove(a)
    blocks.free(1)
    batch = sch.schedule()
    assert [w.seq_id for w in batch.seqs] == [2, 3] and batch.seqs[1].start_pos == 0
    assert len(blocks.table(3)) == 3  # prompt + its output token + the next position
    blocks.check()


def test_blocks_never_grow_past_the_context():
    """A step that asks for positions past the context (speculation's drafts near the end) gets blocks up to the
    context only: a table never outgrows the pool's block-table row."""
    from swiftlm.kv_blocks import KVBlocks
    from swiftlm.sampling import SamplerState, SamplingParams

    blocks = KVBlocks(10, 4)
    sch = Scheduler(max_running=1, blocks=blocks, max_positions=8)
    s = Sequence(1, list(range(6)), SamplingParams(max_tokens=8), SamplerState())
    sch.add(s)
    sch.schedule()
    assert sch.ensure_blocks(s, 20) and len(blocks.table(1)) == 2
