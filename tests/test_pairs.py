"""Scoring text pairs (``LLM.score_pairs``, ``LLM.rerank``, ``/v1/score`` and ``/v1/rerank``
batch requests): a one-label classifier reads each pair as the tokenizer's pair encoding and its
logit through a sigmoid equals transformers' (float32); a language model's score is the cosine
of transformers' last hidden states at each text's last token; 1:1, 1:N and N:N pairs; rerank
orders and cuts; bad requests get their own error lines."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import BPE_TEXT, local_ranks, read_jsonl
from flexgen_dist import LLM
from flexgen_dist.config import ConfigError

Q = "The quick brown fox."
DOCS = ['{"name": "Ada", "age": 36}', "yes no maybe", "The quick fox.", "[1, 2, 3] {\"ok\": true}"]


def _tokenizer() -> Any:
    """A byte-level BPE tokenizer of 300 tokens whose pair encoding is ``A <sep> B <eos>`` (a
    single text: ``A <eos>``), as a cross-encoder's is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(BPE_TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<sep>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.post_processor = processors.TemplateProcessing(single="$A <eos>", pair="$A <sep> $B <eos>",
                                                      special_tokens=[("<eos>", 1), ("<sep>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>", sep_token="<sep>")


def _model(tmp_path: Path, arch: str, labels: int = 1, **extra: Any) -> tuple[Path, torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(3)
    cfg = getattr(transformers, arch.split("For")[0] + "Config")(
        vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, num_labels=labels, **extra)
    m = getattr(transformers, arch)(cfg).eval()
    tok = _tokenizer()
    d = tmp_path / arch
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d, m, transformers.AutoTokenizer.from_pretrained(d)  # as the engine loads it (the model type's class)


def _logit(m: torch.nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        return float(m(input_ids=torch.tensor([ids])).logits[0, 0])


def _last_state(m: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return m.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].double()


def _req(cid: str, url: str, **body: Any) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _body(line: dict) -> dict:
    assert line["error"] is None, line["error"]
    return line["response"]["body"]


@pytest.mark.parametrize("sep", [True, False])
def test_a_cross_encoder_scores_pairs_as_transformers(sep: bool, tmp_path: Path) -> None:
    """A one-label ``Qwen2ForSequenceClassification``: each pair read as the tokenizer's pair
    encoding (``use_sep_token`` false: the two texts joined), sigmoid of the logit; 1:N and N:N;
    ``activation`` off gives the logit; rerank orders by it and keeps ``top_n``."""
    d, m, tok = _model(tmp_path, "Qwen2ForSequenceClassification",
                       **({} if sep else {"use_sep_token": False}))
    ids = [tok(text=Q, text_pair=t)["input_ids"] if sep else tok(Q + t)["input_ids"] for t in DOCS]
    assert (2 in ids[0]) == sep  # the separator is there only in the pair encoding
    logits = torch.tensor([_logit(m, x) for x in ids])
    with LLM(str(d), progress=False, gpu_batch_size=2, num_gpu_batches=2) as llm:
        got = llm.score_pairs(Q, DOCS)
        raw = llm.score_pairs([Q] * len(DOCS), DOCS, activation=False)
        top = llm.rerank(Q, DOCS, top_n=2)
    torch.testing.assert_close(torch.tensor(got), logits.sigmoid(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(raw), logits, atol=2e-5, rtol=1e-4)
    best = logits.argsort(descending=True)[:2].tolist()
    assert [r.index for r in top] == best and [r.document for r in top] == [DOCS[i] for i in best]
    assert top[0].score >= top[1].score


def test_a_language_model_scores_by_cosine_of_embeddings(tmp_path: Path) -> None:
    """Any model that embeds: the cosine of the two texts' last hidden states (after the final
    norm); the query of a 1:N scoring embedded once."""
    d, m, tok = _model(tmp_path, "LlamaForCausalLM")
    q = _last_state(m, tok(Q)["input_ids"])
    want = torch.tensor([float(torch.nn.functional.cosine_similarity(q, _last_state(m, tok(t)["input_ids"]), dim=0))
                         for t in DOCS])
    with LLM(str(d), progress=False, gpu_batch_size=3) as llm:
        got = llm.score_pairs(Q, DOCS)
        pairwise = llm.score_pairs(DOCS, DOCS[::-1])
        ranked = llm.rerank(Q, DOCS)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.double(), atol=1e-5, rtol=1e-4)
    assert pairwise[0] == pytest.approx(pairwise[3], abs=1e-6) and pairwise[1] == pytest.approx(pairwise[2], abs=1e-6)
    assert [r.index for r in ranked] == want.argsort(descending=True).tolist()


def test_batch_score_and_rerank_lines(tmp_path: Path) -> None:
    """``/v1/score`` (each of vLLM's names for the two sides) and ``/v1/rerank`` lines in vLLM's
    format, beside error lines of their own: sides that do not pair, a field not computed, a
    completion asked of a classifier, a pair longer than the model."""
    d, m, tok = _model(tmp_path, "Qwen2ForSequenceClassification")
    probs = torch.tensor([_logit(m, tok(text=Q, text_pair=t)["input_ids"]) for t in DOCS]).sigmoid()
    reqs = [_req("s", "/v1/score", text_1=Q, text_2=DOCS, model="reranker"),
            _req("s-qd", "/score", queries=[Q, Q], documents=DOCS[:2]),
            _req("s-raw", "/v1/score", data_1=Q, data_2=DOCS[2], use_activation=False),
            _req("r", "/v1/rerank", query=Q, documents=DOCS, top_n=3),
            _req("r-all", "/rerank", query=Q, documents=DOCS, return_documents=False),
            _req("bad-pairing", "/v1/score", text_1=DOCS[:3], text_2=DOCS[:2]),
            _req("bad-field", "/v1/rerank", query=Q, documents=DOCS, mm_processor_kwargs={"x": 1}),
            _req("cut", "/v1/score", text_1=Q, text_2="yes no maybe " * 200, truncate_prompt_tokens=20),
            _req("bad-query", "/v1/rerank", query=[Q], documents=DOCS),
            _req("no-completions", "/v1/completions", prompt="hello", max_tokens=2),
            _req("too-long", "/v1/score", text_1=Q, text_2="yes no maybe " * 200)]
    with LLM(str(d), progress=False, gpu_batch_size=2) as llm:
        lines = {x["custom_id"]: x for x in llm.batch(reqs)}
    s = _body(lines["s"])
    assert s["object"] == "list" and s["id"].startswith("score-") and [x["index"] for x in s["data"]] == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor([x["score"] for x in s["data"]]), probs, atol=1e-5, rtol=1e-4)
    tokens = sum(len(tok(text=Q, text_pair=t)["input_ids"]) for t in DOCS)
    assert s["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    qd = [x["score"] for x in _body(lines["s-qd"])["data"]]
    assert qd == pytest.approx(probs[:2].tolist(), abs=1e-5)
    assert _body(lines["s-raw"])["data"][0]["score"] == pytest.approx(float(probs[2].logit()), abs=1e-4)
    r = _body(lines["r"])
    best = probs.argsort(descending=True).tolist()
    assert [x["index"] for x in r["results"]] == best[:3]
    assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in best[:3]]
    assert [x["relevance_score"] for x in r["results"]] == pytest.approx(probs[best[:3]].tolist(), abs=1e-5)
    assert r["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    cut = tok(text=Q, text_pair="yes no maybe " * 200)["input_ids"][-20:]  # the pair's last 20 tokens
    assert _body(lines["cut"])["usage"]["prompt_tokens"] == 20
    assert _body(lines["cut"])["data"][0]["score"] == pytest.approx(float(torch.tensor(_logit(m, cut)).sigmoid()),
                                                                    abs=1e-5)
    every = _body(lines["r-all"])["results"]
    assert [x["index"] for x in every] == best and all("document" not in x for x in every)
    for cid, code, words in (("bad-pairing", "invalid_request", "1:1, 1:N or N:N"),
                             ("bad-field", "unsupported_field", "mm_processor_kwargs"),
                             ("bad-query", "invalid_request", "query must be one"),
                             ("no-completions", "invalid_request", "sequence classifier"),
                             ("too-long", "context_length_exceeded", "positions")):
        assert lines[cid]["error"]["code"] == code and words in lines[cid]["error"]["message"], (cid, lines[cid])


def test_pairs_need_one_label_and_a_tokenizer(tmp_path: Path, tiny_models) -> None:
    """A classifier of several labels gives no one score; a model without a tokenizer cannot
    read text pairs; sides must pair: each a one-line error."""
    d, _, _ = _model(tmp_path, "LlamaForSequenceClassification", labels=3)
    with LLM(str(d), progress=False) as llm:
        with pytest.raises(ConfigError, match="one-label classifier"):
            llm.score_pairs(Q, DOCS)
        line = llm.batch([_req("s", "/v1/score", text_1=Q, text_2=DOCS)])[0]
        assert "3 labels" in line["error"]["message"]
    with LLM(str(tiny_models["llama-gqa"].path), progress=False) as llm:
        with pytest.raises(ConfigError, match="needs the model's tokenizer"):
            llm.score_pairs(Q, DOCS)
        with pytest.raises(ConfigError, match="pair them 1:1, 1:N or N:N"):
            llm.score_pairs(DOCS[:2], DOCS)
        with pytest.raises(ConfigError, match="query must be one non-empty string"):
            llm.rerank(DOCS, DOCS)


def _token_logits(m: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=torch.tensor([ids])).logits[0, -1].double()


def _two_tokens(tok: Any) -> tuple[list[str], list[int]]:
    """Two of the vocabulary's tokens (as it spells them: byte-level BPE's "Ġ" is a space) and
    their ids."""
    names = ["Ġn", "yes"]
    ids = [tok.convert_tokens_to_ids(t) for t in names]
    assert None not in ids and tok.unk_token_id not in ids
    return names, ids


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "CohereForCausalLM"])
def test_a_language_model_read_as_a_classifier_of_its_tokens(arch: str, tmp_path: Path) -> None:
    """``classifier_from_token=["Ġn", "yes"]`` (an LLM reranker such as Qwen3-Reranker): the
    score of a pair is the sigmoid of logit(yes) - logit(no) of transformers' causal LM over the
    two texts joined, its head's scale included (Cohere's ``logit_scale``), a tied head too
    (Qwen3's); one token: its logit."""
    extra = {"tie_word_embeddings": True} if arch.startswith("Qwen3") else {"logit_scale": 0.5}
    d, m, tok = _model(tmp_path, arch, **extra)
    names, (no, yes) = _two_tokens(tok)
    logits = [_token_logits(m, tok(Q + t)["input_ids"]) for t in DOCS]
    want = torch.stack([lg[yes] - lg[no] for lg in logits])
    with LLM(str(d), progress=False, gpu_batch_size=2, classifier_from_token=names) as llm:
        assert llm.model.spec.num_labels == 1 and not llm.model.spec.pair_sep
        got = llm.score_pairs(Q, DOCS)
        top = llm.rerank(Q, DOCS, top_n=1)
        line = llm.batch([_req("r", "/v1/rerank", query=Q, documents=DOCS)])[0]
        with pytest.raises(ConfigError, match=r"generate\(\) needs a language model"):
            llm.generate([Q], gen_len=2)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.sigmoid(), atol=1e-5, rtol=1e-4)
    assert top[0].index == int(want.argmax())
    assert [x["index"] for x in _body(line)["results"]] == want.argsort(descending=True).tolist()
    assert tok(" n", add_special_tokens=False)["input_ids"] == [no]  # a text read as one token serves as well
    with LLM(str(d), progress=False, classifier_from_token=[" n"]) as llm:
        one = llm.score_pairs(Q, DOCS, activation=False)
    torch.testing.assert_close(torch.tensor(one, dtype=torch.float64), torch.stack([lg[no] for lg in logits]),
                               atol=2e-5, rtol=1e-4)


def test_classifier_from_token_refusals(tmp_path: Path) -> None:
    """What cannot be read that way is refused in one line: a soft-capped head (Gemma 2), a
    token the tokenizer does not have as one, three tokens, a model already a classifier."""
    from flexgen_dist.models.source import ModelLoadError

    d, _, _ = _model(tmp_path, "Gemma2ForCausalLM", head_dim=16)
    with pytest.raises(ModelLoadError, match="soft-caps its logits"):
        LLM(str(d), progress=False, classifier_from_token=["Ġn", "yes"])
    d, _, _ = _model(tmp_path, "Qwen2ForCausalLM")
    with pytest.raises(ModelLoadError, match="not one token of this tokenizer"):
        LLM(str(d), progress=False, classifier_from_token=["no", "The quick brown fox jumps"])
    with pytest.raises(ConfigError, match="takes one token"):
        LLM(str(d), progress=False, classifier_from_token=["a", "b", "c"])
    d, _, _ = _model(tmp_path, "Qwen2ForSequenceClassification")
    with pytest.raises(ModelLoadError, match="already a sequence classifier"):
        LLM(str(d), progress=False, classifier_from_token=["yes"])


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("arch", ["Qwen2ForSequenceClassification", "Qwen3ForCausalLM"])
def test_the_batch_command_on_two_ranks_scores_pairs(arch: str, tmp_path: Path) -> None:
    """Two pipeline stages serve a cross-encoder's score and rerank requests as one rank does,
    a language model read as a classifier of its tokens too (the last stage's head from the
    ids rank 0 found)."""
    d, m, tok = _model(tmp_path, arch)
    if arch.endswith("CausalLM"):
        names, (no, yes) = _two_tokens(tok)
        probs = torch.tensor([float(lg[yes] - lg[no]) for lg in
                              (_token_logits(m, tok(Q + t)["input_ids"]) for t in DOCS)]).sigmoid()
        extra = ["--classifier-from-token", *names]
    else:
        probs = torch.tensor([_logit(m, tok(text=Q, text_pair=t)["input_ids"]) for t in DOCS]).sigmoid()
        extra = []
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(_req("s", "/v1/score", text_1=Q, text_2=DOCS)) + "\n"
                   + json.dumps(_req("r", "/v1/rerank", query=Q, documents=DOCS)) + "\n")
    out = tmp_path / "out.jsonl"
    r = local_ranks(["-m", "flexgen_dist.batch", "--model", str(d), "-i", str(inp), "-o", str(out), "--no-progress",
                     "--gpu-batch-size", "2", *extra], nproc=2, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 pair scores" not in r.stdout and "8 pair scores" in r.stdout
    s, rr = (x["response"]["body"] for x in read_jsonl(out))
    torch.testing.assert_close(torch.tensor([x["score"] for x in s["data"]]), probs, atol=1e-5, rtol=1e-4)
    assert [x["index"] for x in rr["results"]] == probs.argsort(descending=True).tolist()


QWEN3_PROMPT = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
                "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_score_template_writes_each_pairs_prompt(tmp_path: Path) -> None:
    """``--score-template`` (a file or its text): each pair rendered over [{query}, {document}]
    with the run's template variables, then read by the judge as transformers reads that text;
    the shipped Qwen3-Reranker template writes its model card's prompt."""
    import transformers

    from flexgen_dist.pairs import pair_ids

    d, m, tok = _model(tmp_path, "Qwen3ForCausalLM", tie_word_embeddings=True)
    names, (no, yes) = _two_tokens(tok)
    tmpl = "Q: {{ messages[0].content }} D: {{ messages[1].content }} {{ tail }}"
    (tmp_path / "t.jinja").write_text(tmpl)
    texts = [f"Q: {Q} D: {t} yes or no?" for t in DOCS]
    want = torch.stack([(lambda lg: lg[yes] - lg[no])(_token_logits(m, tok(x, add_special_tokens=False)["input_ids"]))
                        for x in texts]).sigmoid()
    for given in (str(tmp_path / "t.jinja"), tmpl):
        with LLM(str(d), progress=False, classifier_from_token=names, score_template=given,
                 chat_template_kwargs={"tail": "yes or no?"}) as llm:
            got = llm.score_pairs(Q, DOCS)
            line = llm.batch([_req("r", "/v1/rerank", query=Q, documents=DOCS)])[0]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, atol=1e-5, rtol=1e-4)
        assert [x["index"] for x in _body(line)["results"]] == want.argsort(descending=True).tolist()
    shipped = (Path(__file__).parent.parent / "configs/score_templates/qwen3_reranker.jinja").read_text()
    word = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    text = word.decode(pair_ids(word, "what is x?", "x is y.", template=shipped))
    assert text == QWEN3_PROMPT.format(instruction="Given a web search query, retrieve relevant passages that "
                                                   "answer the query", query="what is x?", doc="x is y.")
    d2, _, _ = _model(tmp_path / "lm", "LlamaForCausalLM")
    with LLM(str(d2), progress=False, score_template=tmpl) as llm:
        with pytest.raises(ConfigError, match="a score template joins a pair for a cross-encoder"):
            llm.score_pairs(Q, DOCS)
    with pytest.raises(ConfigError, match="--score-template .*cannot read it"):
        LLM(str(d), progress=False, score_template=str(tmp_path / "missing.jinja"))


def test_compress_weight_leaves_the_score_head_dense(tmp_path: Path) -> None:
    """--compress-weight compresses the layers as always but keeps a classifier's score rows
    dense (4-bit groups of a one-row difference would move the judge's logit, by up to 1 on
    the bundled model): placed dense, and the head's stored bytes are what the footprint
    predicts."""
    from flexgen_dist.engine.footprint import _cached_slots
    from flexgen_dist.memory.quant import QTensor

    d, m, tok = _model(tmp_path, "Qwen3ForCausalLM", tie_word_embeddings=True)
    names, _ = _two_tokens(tok)
    with LLM(str(d), progress=False, classifier_from_token=names, compress_weight=True) as llm:
        assert len(llm.score_pairs(Q, DOCS)) == len(DOCS)
        head, layer = llm.engine.weights.placed[("head", None)], llm.engine.weights.placed[("layer", 0)]
        assert isinstance(layer["q.w"].data, QTensor) and isinstance(head["score.w"].data, torch.Tensor)
        spec = llm.model.spec
        sizes, _ = _cached_slots(spec, 0, spec.num_layers, True, True, 4, (4, 64))[-1]
        assert head["score.w"].nbytes == spec.hidden_size * 4  # dense float32
        assert sizes[list(head).index("score.w")] == head["score.w"].nbytes  # as the footprint predicts
