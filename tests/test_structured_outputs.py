"""Structured outputs: JSON of a schema, a regex, a choice, a grammar, in the library (through the server:
tests/test_server.py)."""
import json
import re

import jsonschema
import pytest

from minfer import LLM, SamplingParams
from minfer.sampling_params import StructuredOutputsParams as Shape

ASK = "Describe one person as JSON."
# held out: not the schemas the code was tried on; each bounded (strings, arrays) so an answer ends in time
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 16},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    {"type": "object", "additionalProperties": False, "required": ["colour", "size"], "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"], "properties": {
        "tags": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "string", "maxLength": 10}}}},
    {"type": "object", "additionalProperties": False, "required": ["age", "score", "ok"], "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99}, "score": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"}}},
    {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "additionalProperties": False,
                                                               "required": ["id"], "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}}}},
]


def chat(llm: LLM, shape: Shape, **params) -> list:
    sampling = SamplingParams(structured_outputs=shape, **{"max_tokens": 120, "temperature": 0.8, "seed": 3, **params})
    return llm.chat([{"role": "user", "content": ASK}], sampling, use_tqdm=False)[0].outputs


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_answer_is_valid_against_its_schema(llm, index):
    for c in chat(llm, Shape(json=SCHEMAS[index]), n=2):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMAS[index])


def test_regex_choice_grammar_and_json_object(llm):
    for c in chat(llm, Shape(regex=r"[0-9]{3}-[0-9]{4}"), n=2):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) and c.finish_reason == "stop"
    choices = ["yes", "no", "it depends"]
    assert {c.text for c in chat(llm, Shape(choice=choices), n=4, temperature=1.5)} <= set(choices)
    grammar = 'root ::= "The answer is " ("red" | "blue") "."'
    assert chat(llm, Shape(grammar=grammar))[0].text in ("The answer is red.", "The answer is blue.")
    (c,) = chat(llm, Shape(json_object=True), max_tokens=200)
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict)


def test_a_shaped_request_leaves_its_neighbours_alone_and_stop_strings_still_apply(llm):
    prompts = ["The capital of France is", "Count: one, two,"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    words = SamplingParams(temperature=0, max_tokens=30, stop=" ", structured_outputs=Shape(regex="[a-z]+( [a-z]+)+"))
    outs = llm.generate([prompts[0], "Say some words:", prompts[1]], [greedy, words, greedy], use_tqdm=False)
    assert [outs[0].outputs[0].text, outs[2].outputs[0].text] == solo
    shaped = outs[1].outputs[0]
    assert re.fullmatch("[a-z]+", shaped.text) and shaped.finish_reason == "stop" and shaped.stop_reason == " "


def test_bad_shapes_are_refused_with_what_is_wrong(llm):
    for shape, words in [(Shape(json={"type": "objec"}), "structured_outputs.json cannot be compiled: Unsupported type"),
                         (Shape(json="{not json"), "structured_outputs.json cannot be compiled: Expecting"),
                         (Shape(regex="(ab"), "structured_outputs.regex cannot be compiled: .*parenthesis"),
                         (Shape(grammar="root ::= missing"), "structured_outputs.grammar cannot be compiled")]:
        with pytest.raises(ValueError, match=words):
            llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=shape), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar or json_object; got json, regex"):
        Shape(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="got none"):
        Shape()
    with pytest.raises(TypeError, match="choice must be a list of non-empty strings"):
        Shape(choice="yes")
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert not llm.has_unfinished_requests()


def test_speculative_decoding_refuses_a_shape_clearly(tiny_dir):
    spec = LLM(tiny_dir, dtype="float32", device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="structured_outputs is not supported with speculative decoding"):
        spec.generate("a b", SamplingParams(max_tokens=4, structured_outputs=Shape(choice=["x"])), use_tqdm=False)
