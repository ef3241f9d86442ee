"""The README.md of an exported model: what it was trained on, its size, its BLEU, how to use it.

Every number comes from a file the pipeline wrote (the model folder's config.json and the
metrics/*.json files); a number whose file is missing is reported as "not measured", never
guessed. The YAML header is the Hugging Face model card metadata.
"""

from __future__ import annotations

from typing import Any

import yaml

NOT_MEASURED = "not measured"


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return NOT_MEASURED
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _head_size(model: dict, name: str) -> str:
    """d_k or d_v of a model configuration; 0 or absent (folders from before the setting)
    means d_model / heads."""
    size = model.get(name) or 0
    if size:
        return str(size)
    if model.get("d_model") and model.get("heads"):
        return str(model["d_model"] // model["heads"])
    return NOT_MEASURED


def _check_sentence(check: float | None, quantization: str) -> str:
    if quantization != "none":
        found = "" if check is None else (
            f" (per-token log-probabilities of a probe translation differ from aiayn's by up "
            f"to {check:.2g} after quantization)")
        return (f"Its weights are quantized to {quantization} by CTranslate2, which changes "
                f"the computation slightly{found}.")
    found = "" if check is None else f"; this export: {check:.1e}"
    return ("The exported model computes what aiayn's own decoder computes (checked at export "
            "time: per-token log-probabilities of a probe translation agree with aiayn's "
            f"within 1e-3{found}).")


def _cell(text: str) -> str:
    """Table cell text: a pipe inside it would end the cell (GitHub markdown)."""
    return str(text).replace("|", "\\|")


def _metadata(fmt: str, src: str, tgt: str, bleu: dict | None, name: str,
              dataset: str) -> str:
    meta: dict[str, Any] = {
        "language": [src, tgt],
        "tags": ["translation", "transformer", "aiayn"] + (["ctranslate2"] if fmt ==
                                                           "ctranslate2" else []),
        "library_name": fmt,
        "pipeline_tag": "translation",
    }
    if bleu and "sacrebleu" in bleu:
        meta["metrics"] = ["bleu", "chrf"]
        sb = bleu["sacrebleu"]
        metrics = [{"type": "bleu", "name": "sacreBLEU", "value": round(sb["score"], 2),
                    "args": sb.get("signature")}]
        if "chrf" in bleu:
            metrics.append({"type": "chrf", "name": "chrF2",
                            "value": round(bleu["chrf"]["score"], 2),
                            "args": bleu["chrf"].get("signature")})
        meta["model-index"] = [{"name": name, "results": [{
            "task": {"type": "translation", "name": f"Translation {src}-{tgt}"},
            "dataset": {"name": dataset, "type": "translation",
                        "split": bleu.get("split", "test")},
            "metrics": metrics}]}]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def model_card(fmt: str, model_config: dict, *, src_lang: str, tgt_lang: str, beam: int,
               alpha: float, parameters: int, quantization: str = "none",
               metrics: dict[str, dict | None] | None = None,
               check: float | None = None) -> str:
    """Markdown for the folder of a ``fmt`` export ("ctranslate2" or "transformers").

    ``model_config``: config.json of the `aiayn average` folder. ``metrics``: the parsed
    metrics/{bleu,train,download,vocab}.json, each None when absent. ``check``: the largest
    per-token log-probability difference of the export's check (aiayn/export/convert.py).
    """
    metrics = metrics or {}
    bleu, train = metrics.get("bleu"), metrics.get("train")
    download, vocab = metrics.get("download"), metrics.get("vocab")
    m = model_config.get("model", {})
    src, tgt = src_lang, tgt_lang
    name = f"aiayn-transformer-{src}-{tgt}"
    dataset = (download or {}).get("source", NOT_MEASURED)
    lines = [_metadata(fmt, src, tgt, bleu, name, dataset)]
    engine = "CTranslate2" if fmt == "ctranslate2" else "Hugging Face transformers (MarianMT)"
    lines += [
        f"# Transformer {src} → {tgt} (aiayn), for {engine}",
        "",
        "The Transformer of \"Attention Is All You Need\" (Vaswani et al., 2017), trained "
        "with aiayn (the paper reproduced as a DVC pipeline) and exported by `aiayn export "
        f"--format {fmt}`. " + _check_sentence(check, quantization),
        "",
        "## Data",
        "",
        f"- Corpus: {dataset}",
    ]
    if download and "splits" in download:
        splits = download["splits"]
        order = [s for s in ("train", "valid", "test") if s in splits]
        order += [s for s in splits if s not in order]
        kept = ", ".join(f"{split} {_fmt(splits[split].get('kept'))}" for split in order)
        lines.append(f"- Sentence pairs kept: {kept}")
    else:
        lines.append(f"- Sentence pairs: {NOT_MEASURED}")
    size = model_config.get("vocab_size", (vocab or {}).get("size"))
    lines += [
        f"- Vocabulary: one byte-level BPE shared by both languages, {_fmt(size)} tokens "
        "(lossless: decoding gives back the exact text)",
        f"- Direction: {src} → {tgt}",
        "",
        "## Model and training",
        "",
        "| d_model | heads | d_k | d_v | layers (enc + dec) | d_ff | LayerNorm | max positions "
        "| parameters |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {m.get('d_model')} | {m.get('heads')} | {_head_size(m, 'd_k')} | "
        f"{_head_size(m, 'd_v')} | {m.get('encoder_layers')} + "
        f"{m.get('decoder_layers')} | {m.get('d_ff')} | {m.get('norm', 'post')} | "
        f"{m.get('max_positions')} | {_fmt(parameters)} |",
        "",
        f"- Dropout {m.get('dropout')}; one matrix shared by the source and target embeddings "
        "and the output projection"
        + ("" if m.get("output_vocab", "shared") == "shared" else
           ", whose softmax spans only the tokens that occur on the target side of the "
           "training and valid data "
           f"({_fmt((train or {}).get('output_vocab_size'))} tokens; the others are never "
           "generated)")
        + ("; learned positional embeddings (Table 3 row (E))"
           if m.get("positions", "sinusoidal") == "learned" else "; sinusoidal positions")
        + "; ReLU.",
        "- Weights: " + (f"the average of the checkpoints of steps "
                         f"{', '.join(map(str, model_config['averaged_steps']))}"
                         if model_config.get("averaged_steps") else
                         f"averaged checkpoints {NOT_MEASURED}")
        + f"; target tokens seen in training: {_fmt(model_config.get('tokens_seen'))}.",
    ]
    if train:
        lines.append(
            f"- Training: {_fmt(train.get('steps'))} steps, {train.get('precision', '?')} on "
            f"{train.get('device', '?')}, {_fmt(train.get('wall_time_s', 0) / 60)} min; final "
            f"valid loss {_fmt(train.get('valid_loss'), 3)} (label-smoothed), valid perplexity "
            f"{_fmt(train.get('valid_ppl'), 2)}.")
    else:
        lines.append(f"- Training statistics: {NOT_MEASURED}.")
    lines += ["", "## Evaluation", ""]
    if bleu and "sacrebleu" in bleu:
        sb = bleu["sacrebleu"]
        lines += [
            f"Measured by aiayn's own beam search (beam {beam}, alpha {alpha}, GNMT length "
            f"normalisation) on the {bleu.get('split', 'test')} split, "
            f"{_fmt(bleu.get('sentences'))} sentences, against the raw references:",
            "",
            "| metric | score | signature |",
            "|---|---|---|",
            f"| sacreBLEU | {sb['score']:.1f} | `{_cell(sb.get('signature', NOT_MEASURED))}` |",
        ]
        if "chrf" in bleu:
            lines.append(f"| chrF2 | {bleu['chrf']['score']:.1f} | "
                         f"`{_cell(bleu['chrf'].get('signature', NOT_MEASURED))}` |")
        if "tokenized_bleu" in bleu:
            lines.append(f"| tokenized BLEU (tensor2tensor procedure) | "
                         f"{bleu['tokenized_bleu']['score']:.1f} | Moses tokenization, "
                         "compound splitting, multi-bleu |")
        if "lowercase_bleu" in bleu:
            lines.append(f"| lowercased tokenized BLEU | {bleu['lowercase_bleu']['score']:.1f} "
                         "| Moses tokenization, lowercased, multi-bleu -lc |")
    else:
        lines.append(f"BLEU: {NOT_MEASURED} (no metrics/bleu.json when this model was "
                     "exported; run `aiayn score`).")
    lines += [
        "",
        f"{engine} normalises beam scores by |Y|^alpha, aiayn by GNMT's ((5 + |Y|) / 6)^alpha: "
        "with alpha > 0 a few outputs can differ from aiayn's. At alpha 0 the outputs are "
        "the same"
        + (", and with `aiayn translate --length-norm length` too but where CTranslate2 "
           "stops a beam early: it ends once `beam_size` hypotheses have finished (patience "
           "1, its default), where aiayn searches on while a live one can still win; "
           "`patience=1000` in `translate_batch` makes its search exact."
           if fmt == "ctranslate2" else
           ", and with `aiayn translate --length-norm length` too."),
        "",
        "## Use",
        "",
    ]
    if fmt == "transformers":
        lines += [
            "```python",
            "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
            "tokenizer = AutoTokenizer.from_pretrained(\"DIR\")",
            "model = AutoModelForSeq2SeqLM.from_pretrained(\"DIR\")",
            "batch = tokenizer([\"The house is small.\"], return_tensors=\"pt\", padding=True)",
            "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
            "```",
            "",
            "With transformers 4.x also `pipeline(\"translation\", model=\"DIR\")` (transformers "
            "5 removed the translation pipeline). The generation defaults "
            f"(`generation_config.json`) are beam {beam}, `length_penalty` {alpha}, "
            "`early_stopping=\"never\"` (the exact stopping rule).",
            "",
            "## How it maps onto MarianMT",
            "",
            "- Marian lays out its sinusoid as [sin | cos] halves, aiayn interleaves sin and "
            "cos; the hidden dimensions are permuted (evens, then odds) consistently through "
            "every weight, which leaves the computation unchanged.",
            "- aiayn's fused q/k/v projections are split into q_proj, k_proj, v_proj.",
            "- Decoder start = `<s>` (id 1); the tokenizer appends `</s>` to the source; "
            "`<pad>` and `<s>` are never generated (`final_logits_bias` -inf at ids 0 and 1, "
            "aiayn's beam search rule); no forced EOS at the maximum length.",
        ]
    else:
        lines += [
            "```python",
            "import ctranslate2, tokenizers",
            "tok = tokenizers.Tokenizer.from_file(\"DIR/tokenizer.json\")",
            "tok.encode_special_tokens = True  # \"<pad>\" in a sentence is text, as in training",
            "translator = ctranslate2.Translator(\"DIR\")  # compute_type=\"int8\" for speed",
            "out = translator.translate_batch([tok.encode(\"The house is small.\").tokens + "
            "[\"</s>\"]], beam_size=4, length_penalty=0.6, min_decoding_length=0,",
            f"    max_decoding_length={m.get('max_positions')})  # the model's max_positions",
            "print(tok.decode([tok.token_to_id(t) for t in out[0].hypotheses[0]]))",
            "```",
            "",
            "The source gets `</s>` appended; `min_decoding_length=0` allows an empty output "
            "as aiayn does; `max_decoding_length` stops where the model's positions end "
            "(CTranslate2's default, 256, fails past them). `<pad>` and `<s>` are never "
            "generated (the output layer's bias is -inf there, aiayn's beam search rule).",
        ]
    lines += [
        "",
        "`aiayn.json` in this folder records the model configuration and the export.",
        "",
    ]
    return "\n".join(lines)
