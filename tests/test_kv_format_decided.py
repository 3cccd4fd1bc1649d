"""A request's KV format is decided once: ``SamplingParams.validate`` parses its fields, the engine completes
them at admission with the served model's options and stores the result on the sequence, and every work item
the scheduler hands the backend carries that value (no backend parses a preset)."""

from __future__ import annotations

from swiftlm.intake import make_live
from swiftlm.sampling import SamplerState, SamplingParams
from swiftlm.scheduler import Scheduler, Sequence
from swiftlm.turboquant import presets
from swiftlm.turboquant.presets import KVFormat, affine, parse_turbo


def _admit(params: SamplingParams, default: KVFormat) -> Sequence:
    return make_live(1, [1, 2, 3], params, None, 0.0, tokenizer=None, vocab_size=100, kv_default=default).seq


def test_admission_decides_the_format_once(monkeypatch):
    default = parse_turbo("k4v3", window=16, threshold=8, keep_layers=1)
    assert _admit(SamplingParams().validate(), default).kv_format is default
    assert _admit(SamplingParams(turbo_kv="off").validate(), default).kv_format == KVFormat()
    assert _admit(SamplingParams(kv_bits=4, kv_group_size=32).validate(), default).kv_format == affine(4, 32)
    params = SamplingParams(turbo_kv="k3qjl-v3").validate(100)
    # after validation nothing parses a preset again: admission only completes the parsed value
    monkeypatch.setattr(presets, "parse_turbo", None)
    seq = _admit(params, default)
    assert seq.kv_format == KVFormat("turbo", 3, 3, True, window=16, threshold=8, keep_layers=1)


def test_every_work_item_carries_the_sequences_format():
    fmt = parse_turbo("k3v2", window=4)
    sch = Scheduler(max_running=2, prefill_size=2)
    for sid, f in ((1, fmt), (2, KVFormat())):
        sch.add(Sequence(sid, [5, 6, 7], SamplingParams(), SamplerState(), kv_format=f))
    steps = 0
    while any(s.in_prefill for s in sch.running) or sch.waiting:
        batch = sch.schedule()
        assert batch.seqs
        for w in batch.seqs:
            assert w.kv_format == (fmt if w.seq_id == 1 else KVFormat())
            seq = next(s for s in sch.running if s.seq_id == w.seq_id)
            seq.num_computed = w.start_pos + len(w.tokens)
            if w.sample:
                seq.output_tokens.append(9)
        steps += 1
    decode = sch.schedule()  # decode rows
    assert [(w.seq_id, w.kv_format) for w in decode.seqs] == [(1, fmt), (2, KVFormat())]
    assert steps == 2
