"""response_format json_object / json_schema, enforced by constrained decoding (llguidance)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from conftest import needs_mlx

from swiftlm.chat.structured import Constraint, grammar_for
from swiftlm.errors import InvalidRequest
from swiftlm.registry import resolve
from swiftlm.sampler import sample_row
from swiftlm.sampling import NumpyOps, SamplerState, SamplingParams
from swiftlm.tokenizer import load_gguf_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(resolve(None).gguf_meta)


def test_invalid_schema_and_type_are_request_errors():
    with pytest.raises(InvalidRequest) as e:
        grammar_for({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequest):
        grammar_for({"type": "yaml"})
    assert grammar_for({"type": "text"}) is None


def test_random_logits_under_the_mask_always_give_schema_valid_json(tok):
    """Any model, even pure noise, produces valid JSON once the mask is applied."""
    g = grammar_for({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    rng = np.random.default_rng(0)
    for seed in range(5):
        st = SamplerState(seed=seed, constraint=Constraint(tok, g, tok.vocab_size))
        out = []
        for _ in range(200):
            t, _, _ = sample_row(
                NumpyOps(), rng.normal(0, 2, tok.vocab_size).astype(np.float32), SamplingParams(temperature=1.0), st
            )
            if t in tok.eos_token_ids:
                break
            out.append(t)
        else:
            pytest.fail("grammar did not terminate")
        jsonschema.validate(json.loads(tok.decode(out)), PERSON)


@needs_mlx
def test_smollm2_json_schema_validates(mlx_llm):
    g = grammar_for({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    msgs = [{"role": "user", "content": "Invent a person. Answer in JSON with a name and an age."}]
    # seeds 0..2 as the three choices of one request (seed 0 + i), decoded in one batch
    outs = mlx_llm.generate(msgs, SamplingParams(max_tokens=48, temperature=0.8, seed=0, n=3, grammar=g)).outputs
    assert len(outs) == 3
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


@pytest.mark.slow
def test_smollm2_json_schema_twenty_of_twenty_on_torch(torch_llm):
    """Twenty seeded samples (seeds 0..19), each a stopped, schema-valid object.  They run as one
    request with n=20 (choice i gets seed 0 + i): the prompt is prefilled once and forked, and the
    choices decode together in the engine's batch, each under its own grammar state."""
    g = grammar_for({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    msgs = [{"role": "user", "content": "Invent a person. Answer in JSON with a name and an age."}]
    outs = torch_llm.generate(msgs, SamplingParams(max_tokens=48, temperature=0.8, seed=0, n=20, grammar=g)).outputs
    assert len(outs) == 20
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
