"""The incremental detokenizer against decoding everything again, token by token; and a sequence's text."""
import random

import pydoc_data.topics
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from minfer import SamplingParams
from minfer.detokenizer import IncrementalDetokenizer
from minfer.outputs import RequestMetrics
from minfer.sampling_params import RequestOutputKind
from minfer.sequence import Sequence

TEXT = ("\n".join(list(pydoc_data.topics.topics.values())[:3])
        + " héllo 世界 🤖🎉 naïve — “quoted” <|im_end|> after the special token")


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A small SentencePiece-style BPE (spaces as '▁', the decoder drops the first token's leading
    space), trained here: decoding a token alone loses its space, so context matters."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(list(pydoc_data.topics.topics.values())[:40],
                                  trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


def check_every_step(tokenizer, ids: list[int], skip_special_tokens: bool) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    for i, token in enumerate(ids):
        committed = detokenizer.text
        new = detokenizer.append(token)
        full = tokenizer.decode(ids[:i + 1], skip_special_tokens=skip_special_tokens)
        assert detokenizer.text == committed + new
        assert detokenizer.flush() == full, f"token {i}"
        # what is shown never changes later: the text so far is the full decode, less an incomplete character
        assert detokenizer.text == (full.rstrip("\ufffd") if full.endswith("\ufffd") else full)[:len(detokenizer.text)]
        if not full.endswith("\ufffd"):
            assert detokenizer.text == full


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_real_text_and_random_ids_as_decoding_everything_again(llm, skip_special_tokens):
    tokenizer = llm.tokenizer
    rng = random.Random(0)
    random_ids = [rng.randrange(len(tokenizer)) for _ in range(600)]  # bytes split over tokens, at random
    for ids in (tokenizer.encode(TEXT)[-600:], random_ids):
        check_every_step(tokenizer, ids, skip_special_tokens)


def test_multibyte_characters_wait_for_their_last_byte(llm):
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("🤖")
    assert len(ids) > 1  # one character in several byte-level tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.append(t) for t in ids] == [""] * (len(ids) - 1) + ["🤖"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.append(ids[0])
    assert detokenizer.text == "" and detokenizer.flush() == tokenizer.decode(ids[:1]) == "\ufffd"


def test_sentencepiece_spaces_need_the_token_before(metaspace_tokenizer):
    ids = metaspace_tokenizer.encode("the value of the expression is returned to the caller")
    one_by_one = "".join(metaspace_tokenizer.decode([t]) for t in ids)
    assert one_by_one != metaspace_tokenizer.decode(ids)  # the spaces are lost without context
    check_every_step(metaspace_tokenizer, ids, skip_special_tokens=True)
    check_every_step(metaspace_tokenizer, metaspace_tokenizer.encode(TEXT[:3000]), skip_special_tokens=False)


def test_each_token_decodes_a_few_tokens_not_the_whole_output(llm):
    # decoding everything again reads n(n+1)/2 token ids for n tokens; the windows read a few per token
    decoded = []
    tokenizer = llm.tokenizer

    class Counting:
        def decode(self, ids, **kwargs):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode(TEXT)[:2000]
    detokenizer = IncrementalDetokenizer(Counting())
    for token in ids:
        detokenizer.append(token)
    assert detokenizer.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(decoded) <= 8 and sum(decoded) < 6 * len(ids)


def sequence(tokenizer, **params) -> Sequence:
    p = SamplingParams(**params)
    return Sequence([1, 2, 3], p, p.max_tokens, 0, RequestMetrics(0.0, num_prompt_tokens=3))


def feed(seq: Sequence, ids: list[int], tokenizer) -> None:
    for token in ids:
        seq.append(token, tokenizer, {tokenizer.eos_token_id})
        if seq.finished:
            return


def test_a_sequence_stops_at_a_stop_string_split_over_tokens(llm):
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("The answer is forty-two. The end of it.")
    for include in (False, True):
        seq = sequence(tokenizer, max_tokens=100, stop=["forty-two."], include_stop_str_in_output=include)
        feed(seq, ids, tokenizer)
        assert seq.finish_reason == "stop" and seq.stop_reason == "forty-two."
        assert seq.text == ("The answer is forty-two." if include else "The answer is ")


def test_the_stop_token_is_in_the_ids_but_not_in_the_text(llm):
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("Hello there")
    stop = tokenizer.encode(" world")[0]
    for include, text in ((False, "Hello there"), (True, "Hello there world")):
        seq = sequence(tokenizer, max_tokens=100, stop_token_ids=[stop], include_stop_str_in_output=include)
        feed(seq, ids + [stop], tokenizer)
        assert seq.output_ids == ids + [stop] and seq.text == text and seq.stop_reason == stop


def test_a_sequence_never_shows_half_a_character(llm):
    # the server streams a sequence's text as it grows (minfer.serving.protocol): nothing shown may change later
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("🤖 and 世界, café")
    seq = sequence(tokenizer, max_tokens=100)
    shown = []
    for token in ids:
        seq.append(token, tokenizer, set())
        shown.append(seq.text)
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))
    assert "\ufffd" not in "".join(shown) and shown[-1] == tokenizer.decode(ids)


def test_a_sequence_ended_by_length_shows_the_full_decode(llm):
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("ok 🤖")
    seq = sequence(tokenizer, max_tokens=len(ids) - 1)  # ends inside the emoji's bytes
    feed(seq, ids, tokenizer)
    assert seq.finish_reason == "length" and seq.text == tokenizer.decode(ids[:-1]) and seq.text.endswith("\ufffd")


def test_token_ids_between_is_a_slice_of_tokens_and_drafts(llm):
    seq = sequence(llm.tokenizer, max_tokens=100)
    seq.output_ids += [10, 11, 12]
    seq.spec_token_ids = [20, 21]
    known = seq.token_ids + seq.spec_token_ids
    assert seq.num_tokens == len(seq.token_ids) == 6
    for start in range(len(known) + 1):
        for stop in range(start, len(known) + 2):
            assert seq.token_ids_between(start, stop) == known[start:stop]


def test_a_stream_reads_each_logprob_entry_a_bounded_number_of_times(monkeypatch):
    """A streamed completion's logprob offsets continue across chunks; each chunk's offsets come from the state
    the stream keeps, not from a pass over all earlier entries (that was quadratic: 4 s of event loop for 8192
    tokens)."""
    from minfer.logprobs import Logprob
    from minfer.outputs import CompletionOutput
    from minfer.serving import protocol

    reads = []
    chosen = protocol._chosen
    monkeypatch.setattr(protocol, "_chosen", lambda entry: reads.append(1) or chosen(entry))
    words = [f"w{i} " for i in range(300)]
    entries = [{i: Logprob(-0.5, 1, word)} for i, word in enumerate(words)]
    state, offsets = protocol.StreamState(None), []
    for n in range(1, len(words) + 1):
        c = CompletionOutput(0, "".join(words[:n]), list(range(n)), "length" if n == len(words) else None,
                             logprobs=entries[:n])
        state.first((0, 0))
        delta = state.delta((0, 0), c)
        if delta is not None:
            text, start, text_offset = delta
            offsets += protocol.completion_logprobs(c.logprobs, start, text_offset)["text_offset"]
    whole = protocol.completion_logprobs(entries)["text_offset"]
    assert offsets == whole == [sum(map(len, words[:i])) for i in range(len(words))]
    assert len(reads) <= 3 * len(words)  # stream and whole answer: each entry read a fixed number of times


def test_the_streaming_decoder_and_the_windows_agree_token_by_token(llm):
    """A fast tokenizer goes through `tokenizers`' DecodeStream; any other tokenizer through decode windows."""
    tokenizer = llm.tokenizer

    class SlowPath:  # only decode(): no Rust backend to stream with
        def decode(self, ids, **kwargs):
            return tokenizer.decode(ids, **kwargs)

    rng = random.Random(1)
    ids = tokenizer.encode(TEXT)[-300:] + [rng.randrange(len(tokenizer)) for _ in range(300)]
    stream, windows = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(SlowPath())
    assert stream._stream is not None and windows._stream is None
    for token in ids:
        assert stream.append(token) == windows.append(token)
        assert stream.flush() == windows.flush()


@pytest.mark.parametrize("params", [
    dict(max_tokens=100), dict(max_tokens=7), dict(max_tokens=100, include_stop_str_in_output=True),
    dict(max_tokens=100, skip_special_tokens=False), dict(max_tokens=100, stop_token_ids=[0])])
def test_final_only_text_is_decoded_once_at_the_end_and_equals_the_streamed_text(llm, params):
    """A sequence whose output is reported only at its end (RequestOutputKind.FINAL_ONLY, as LLM.generate asks)
    keeps just the ids while it grows, then ends with the same text, reason and ids as one decoded token by token."""
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("ok 🤖 café <|im_end|> more") + [tokenizer.eos_token_id] + tokenizer.encode(" after")
    streamed, final = sequence(tokenizer, **params), sequence(tokenizer, output_kind=RequestOutputKind.FINAL_ONLY, **params)
    assert streamed.params.text_each_step and not final.params.text_each_step
    feed(streamed, ids, tokenizer)
    for i, token in enumerate(ids):
        final.append(token, tokenizer, {tokenizer.eos_token_id})
        if final.finished:
            break
        assert final.text == "" and final.detokenizer.token_ids == final.output_ids[:i + 1]  # no text made yet
    assert final.finished and final.text == streamed.text != ""
    assert (final.finish_reason, final.stop_reason, final.output_ids) == (
        streamed.finish_reason, streamed.stop_reason, streamed.output_ids)


def test_final_only_with_stop_strings_decodes_every_token_and_an_abort_decodes_what_it_has(llm):
    tokenizer = llm.tokenizer
    # stop strings are found in the text as it grows: such a sequence decodes every token whatever its output kind
    assert SamplingParams(stop=["x"], output_kind=RequestOutputKind.FINAL_ONLY).text_each_step
    ids = tokenizer.encode("The answer is forty-two. The end of it.")
    seq = sequence(tokenizer, max_tokens=100, stop=["forty-two."], output_kind=RequestOutputKind.FINAL_ONLY)
    feed(seq, ids, tokenizer)
    assert seq.text == "The answer is "
    seq = sequence(tokenizer, max_tokens=100, output_kind=RequestOutputKind.FINAL_ONLY)
    feed(seq, ids[:4], tokenizer)  # not finished: an engine that aborts it reports what it has
    assert seq.text == "" and seq.to_output().text == tokenizer.decode(ids[:4])
