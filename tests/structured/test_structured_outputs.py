"""Structured outputs offline (krait/structured): a tiny random model, whose unconstrained
output is noise, returns JSON that validates against each request's schema, and text that
matches each regex, choice and EBNF grammar, under greedy, sampling, penalties and logprobs,
with async scheduling and with speculative decoding; compiles run off the loop (a slow or
failing grammar stalls no other request); a batch without structured rows does no mask work."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from krait import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from krait.structured.grammar import validate_structured  # noqa: E402
from tests.utils import (  # noqa: E402
    SPEC_SCHEMA,
    TINY_VOCAB,
    make_tiny_llama,
    structured_reference,
)

VOCAB = TINY_VOCAB + 32  # logits wider than the tokenizer: the padding must be masked


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("structured"), vocab_size=VOCAB)
    return LLM(model_dir, max_model_len=256, max_num_seqs=128)


def _schemas() -> list[dict]:
    """Small bounded schemas a random walk completes (strings capped, integers in ranges)."""
    word = {"type": "string", "maxLength": 4}
    small = {"type": "integer", "minimum": 0, "maximum": 50}
    return [
        {"type": "object", "properties": {"a": small}, "required": ["a"]},
        {"type": "object", "properties": {"ok": {"type": "boolean"}, "w": word},
         "required": ["ok", "w"]},
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": -5, "maximum": 5}},
         "required": ["color", "n"]},
        {"type": "array", "items": small, "minItems": 1, "maxItems": 3},
        {"type": "object", "properties": {"p": {"type": "object", "properties": {
            "x": small, "y": small}, "required": ["x", "y"]}}, "required": ["p"]},
        {"type": "object", "properties": {"tags": {"type": "array", "items": word,
                                                   "maxItems": 2}, "id": small},
         "required": ["tags", "id"]},
        {"type": "object", "properties": {"kind": {"const": "point"}, "v": {"type": "null"}},
         "required": ["kind", "v"]},
        {"enum": ["alpha", "beta", 7, True]},
        {"type": "object", "properties": {"name": word, "age": small, "vip": {"type": "boolean"}},
         "required": ["name", "age"]},
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]{2,3}$"}},
         "required": ["s"]},
    ]


def _variants(i: int) -> dict:
    """Sampling settings cycled over the requests: greedy, sampling, penalties, logprobs."""
    return [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=i),
        dict(temperature=0.8, top_p=0.9, top_k=50, seed=i),
        dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, seed=i),
        dict(temperature=1.0, logprobs=2, seed=i),
    ][i % 5]


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="structured_outputs: exactly one.*none"):
        StructuredOutputsParams().validate()
    with pytest.raises(ValueError, match="exactly one.*json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+").validate()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[]).validate()
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="{not json").validate()
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams()).validate()
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key() == StructuredOutputsParams(json='{"a": 2, "b": 1}').key()  # canonical


@pytest.mark.parametrize("so,field", [
    (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_invalid_constraints_are_value_errors(so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        validate_structured(so)


def test_invalid_schema_refused_by_generate(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["x"], bad, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_json_schemas_validate(llm):
    """200 requests over 10 schemas and 5 sampling settings, in one generate call."""
    schemas = _schemas()
    params, wanted = [], []
    for i in range(200):
        schema = schemas[i % len(schemas)]
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=i % 3 == 0)
        params.append(SamplingParams(max_tokens=96, structured_outputs=so, **_variants(i)))
        wanted.append(schema)
    prompts = [f"item {i}:" for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema, p in zip(outs, wanted, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, schema)
        try:
            jsonschema.validate(json.loads(c.text), schema)
        except ValueError as e:
            raise AssertionError(repr(c.text) + repr(c.token_ids)) from e
        if p.logprobs is not None:  # logprobs of the masked distribution: finite for the token
            assert len(c.logprobs) == len(c.token_ids)
            assert all(e[t].logprob > -1e9 for e, t in zip(c.logprobs, c.token_ids))


def test_regex_choice_and_grammar_match(llm):
    regexes = [r"[a-c]{2,4}-\d\d", r"(yes|no)!", r"\d{3}", r"[A-Z][a-z]{0,3}"]
    choices = [["left", "right"], ["maybe so", "no", "yes"], ["a b", "c"]]
    grammar = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [0-9] | "x"'
    params, checks = [], []
    for i in range(60):
        kind = i % 3
        if kind == 0:
            rx = regexes[i % len(regexes)]
            so, check = StructuredOutputsParams(regex=rx), (lambda t, rx=rx: re.fullmatch(rx, t))
        elif kind == 1:
            ch = choices[i % len(choices)]
            so, check = StructuredOutputsParams(choice=ch), (lambda t, ch=ch: t in ch)
        else:
            so = StructuredOutputsParams(grammar=grammar)
            check = lambda t: re.fullmatch(r"\([0-9x](,[0-9x]){0,2}\)", t)
        params.append(SamplingParams(max_tokens=24, structured_outputs=so, **_variants(i)))
        checks.append(check)
    outs = llm.generate([f"q{i}" for i in range(60)], params, use_tqdm=False)
    for out, check in zip(outs, checks):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_json_object_and_mixed_with_plain_rows(llm):
    """json_object rows beside unconstrained ones; the plain rows' greedy tokens are those of
    a batch without structured rows."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["plain a", "plain b"], plain, use_tqdm=False)
    obj = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=(
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True)))
    outs = llm.generate(["plain a", "obj 1", "plain b", "obj 2"], [plain, obj, plain, obj],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    for o in (outs[1], outs[3]):
        c = o.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_no_mask_work_without_structured_rows(llm, monkeypatch):
    import krait.runner.model_runner as mr

    def boom(*a, **k):
        raise AssertionError("bitmask applied in a batch without structured rows")

    monkeypatch.setattr(mr, "apply_token_bitmask", boom)
    engine = llm.llm_engine
    seen = []
    # the engine steps through its executor (which binds the runner's method at start-up)
    real = engine.executor.execute_model
    monkeypatch.setattr(engine.executor, "execute_model",
                        lambda s: seen.append(s.grammar_bitmask) or real(s))
    llm.generate(["a", "b"], SamplingParams(temperature=1.0, max_tokens=8, seed=1),
                 use_tqdm=False)
    assert seen and all(b is None for b in seen)


def test_slow_and_failing_grammars_stall_nothing(llm, monkeypatch):
    """A grammar that compiles slowly (or fails) holds only its own request: plain and other
    structured requests finish meanwhile; the failing one ends with finish_reason "error"."""
    engine = llm.llm_engine
    mgr = engine.structured_manager()
    release = threading.Event()
    real = mgr.compile

    def compile(kind, spec):
        if "slow" in spec:
            assert release.wait(30)
        if "fail" in spec:
            raise RuntimeError("simulated compiler failure")
        return real(kind, spec)

    monkeypatch.setattr(mgr, "compile", compile)
    slow = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="slow"))
    fail = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="fail"))
    ok = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="ok+"))
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("slow", "s", slow)
    engine.add_request("fail", "f", fail)
    engine.add_request("ok", "o", ok)
    engine.add_request("plain", "p", plain)
    done = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if {"fail", "ok", "plain"} <= set(done):
            break
    assert "slow" not in done  # still waiting for its grammar, not dropped
    assert done["fail"].finish_reason == "error" and "failed to compile" in done["fail"].stop_reason
    assert done["ok"].finish_reason == "stop" and re.fullmatch("ok+", done["ok"].text)
    assert done["plain"].finish_reason == "length"
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert done["slow"].text == "slow" and done["slow"].finish_reason == "stop"


class _ScriptedDrafter:
    """The runner's drafter interface: proposes each request's known continuation (`want`,
    found by its prompt) with its first j drafts right and the rest off by one, j cycling
    0..k; a row whose continuation is unknown gets k copies of its last token."""

    def __init__(self, prompts: list[list[int]], want: list[list[int]], k: int) -> None:
        self.prompts, self.want, self.k, self.calls = prompts, want, k, 0

    def propose(self, token_table, rows, num_tokens, max_drafts):
        drafts = np.zeros((len(rows), self.k), dtype=np.int32)
        counts = np.minimum(max_drafts, self.k).astype(np.int32)
        for j, (row, n) in enumerate(zip(rows, num_tokens)):
            p = next((i for i, pr in enumerate(self.prompts)
                      if token_table[row, : len(pr)].tolist() == pr), None)
            if p is None:
                drafts[j] = token_table[row, n - 1]
                continue
            out = int(n) - len(self.prompts[p])
            cont = self.want[p][out : out + self.k]  # (sampled rows may run past it)
            cont += [3] * (self.k - len(cont))
            right = self.calls % (self.k + 1)
            self.calls += 1
            drafts[j] = cont[:right] + [(t + 1) % TINY_VOCAB for t in cont[right:]]
        return drafts, counts


def test_structured_rows_verify_drafts(tmp_path):
    """Host-proposed drafts for structured rows: cut to what the grammar allows, each verified
    position masked by the grammar after the drafts before it. Greedy output equals the
    output without speculation token for token, drafts were accepted and rejected; sampled
    structured rows with drafts still validate."""
    model_dir, so, prompts, ref = structured_reference(tmp_path / "m")
    schema = SPEC_SCHEMA
    want = [o.outputs[0].token_ids for o in ref]
    k = 3
    llm = LLM(model_dir, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    drafter = _ScriptedDrafter([o.prompt_token_ids for o in ref], want, k)
    llm.llm_engine.runner.drafter = drafter
    outs = llm.generate(prompts, so, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics["spec_num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["spec_num_accepted_tokens"] for o in outs)
    assert 0 < accepted < drafted, (accepted, drafted)
    # the off-by-one drafts the grammar forbids were cut before verification
    assert drafted < drafter.calls * k
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(json=schema))
    for o in llm.generate(prompts, sampled, use_tqdm=False):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_structured_rows_with_speculative_decoding(tmp_path):
    """ngram drafting on: structured and plain rows in one batch; every structured output
    validates."""
    model_dir = make_tiny_llama(tmp_path / "m")
    llm = LLM(model_dir, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    schema = {"type": "object", "properties": {"k": {"enum": ["ab", "cd"]}}, "required": ["k"]}
    so = SamplingParams(temperature=0.0, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(json=schema))
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["a b a b a b a b", "x y x y x y x y", "a b a b a b a b", "x y x y x y"]
    outs = llm.generate(prompts, [so, plain, so, plain], use_tqdm=False)
    for o in (outs[0], outs[2]):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_compiles_are_cached_and_n_children_each_match(llm, monkeypatch):
    """One compile per (kind, spec), however many requests share it; n > 1 children each
    follow the grammar with their own matcher."""
    mgr = llm.llm_engine.structured_manager()
    calls = []
    real = mgr.compile
    monkeypatch.setattr(mgr, "compile", lambda kind, spec: calls.append(kind) or real(kind, spec))
    schema = {"type": "object", "properties": {"z": {"enum": [1, 2, 3]}}, "required": ["z"]}
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=dict(schema)))
    outs = llm.generate([f"p{i}" for i in range(6)], params, use_tqdm=False)
    assert calls == ["json"]
    for out in outs:
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)


def test_hybrid_model(tmp_path):
    """A Mamba2 + attention hybrid: the grammar acts on the logits alone, whatever the layers."""
    from tests.utils import make_tiny_hybrid, require_arch

    require_arch("granitemoehybrid")
    llm = LLM(make_tiny_hybrid(tmp_path / "h", "granitemoehybrid"), max_model_len=256)
    schema = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}}, "required": ["v"]}
    params = [SamplingParams(temperature=float(i % 2), seed=i, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i in range(8)]
    for out in llm.generate([f"h{i}" for i in range(8)], params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_missing_xgrammar_is_a_clear_value_error(monkeypatch):
    import sys

    from krait.structured.grammar import load_xgrammar

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as on an image without it
    with pytest.raises(ValueError, match="structured_outputs: .*pip install xgrammar"):
        load_xgrammar()
    with pytest.raises(ValueError, match="pip install xgrammar"):
        validate_structured(StructuredOutputsParams(regex="never-checked-[0-9]"))  # uncached


def test_chat_with_tools_offline(llm):
    """LLM.chat renders tools through the template; a tool_choice grammar forces a call."""
    from krait.server.tool_calls import forced_calls, tool_choice_constraint

    template = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}}}]
    conv = [{"role": "user", "content": "pick one"}]
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
        tool_choice_constraint(tools, "required", parallel=False)))
    (out,) = llm.chat(conv, params, use_tqdm=False, chat_template=template, tools=tools)
    (bare,) = llm.chat(conv, params, use_tqdm=False, chat_template=template)
    assert len(out.prompt_token_ids) > len(bare.prompt_token_ids) + 10
    (call,) = forced_calls(out.outputs[0].text, "required")
    assert call.name == "pick" and json.loads(call.arguments)["n"] in (1, 2)


def test_min_tokens_does_not_hold_back_the_grammars_end(llm):
    params = SamplingParams(temperature=1.0, seed=0, min_tokens=6, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=["ab"]))
    (out,) = llm.generate(["m"], params, use_tqdm=False)
    assert out.outputs[0].text == "ab" and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_steps_fill_masks_while_the_forward_runs(tmp_path, monkeypatch, async_scheduling):
    """Under async scheduling a step with structured rows queues its forward first and gets
    its masks after the step before is read back (`grammar_deferred`); synchronous steps fill
    them before the launch. Either way every output matches its grammar."""
    model_dir = make_tiny_llama(tmp_path / "m", vocab_size=VOCAB)
    llm = LLM(model_dir, max_model_len=128, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    deferred = []
    real = engine.executor.execute_model
    monkeypatch.setattr(engine.executor, "execute_model",
                        lambda s: deferred.append(s.grammar_deferred) or real(s))
    rx = r"[a-c]{3,6}-\d\d"
    params = [SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(regex=rx),
                             **_variants(i)) for i in range(6)]
    outs = llm.generate([f"p{i}" for i in range(6)] + ["plain"],
                        params + [SamplingParams(max_tokens=8)], use_tqdm=False)
    for o in outs[:6]:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(rx, o.outputs[0].text)
    assert any(deferred) == async_scheduling
