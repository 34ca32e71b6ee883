"""Make the small Llama 3, Qwen2, Qwen3, Phi-3, Mistral, Gemma 3, Qwen3-MoE and Mixtral fixtures and record llama.cpp's logits for them.

Each fixture is a Hugging Face `transformers` model built from a config with random weights and a
real tokenizer cut down to its first few thousand pieces (Llama 3's and Qwen2's byte-level BPE,
Phi-3's and Llama 2's SentencePiece, taken from llama.cpp's vocab files in ../shared/fixtures/vocab), converted
by llama.cpp's own convert_hf_to_gguf.py and quantized by its quantizer. The converter recognizes a
BPE pre-tokenizer by hashing a full vocabulary's output, which a cut-down one cannot reproduce, so
the pre-tokenizer name is pinned to the original vocabulary's (tokenizer.ggml.pre).

Two Pythons do the work: one with torch and transformers converts, one with llama-cpp-python
quantizes and records the references (the same llama.cpp version as the converter):

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz     # llama.cpp is under vendor/llama.cpp
    python -m venv conv && conv/bin/pip install torch==2.13.0 transformers sentencepiece safetensors protobuf
    conv/bin/python scripts/make_arch_fixtures.py convert --llama-cpp llama_cpp_python-0.3.36/vendor/llama.cpp
    python scripts/make_arch_fixtures.py quantize  # the Python with llama-cpp-python 0.3.36

`convert` writes F32 GGUFs to --work (default /tmp/mlxllama-arch); `quantize` writes
tests/fixtures/<name>.gguf and tests/reference/arch/<name>.npz (see make_llama_reference.py for
what a reference holds, and PROMPTS below for the prompts), recorded with llama.cpp's n_ctx at 512.
A fixture with `contexts` also gets PASSAGE recorded at each of those n_ctx, under `ctx<n_ctx>/`:
Phi-3's LongRoPE factors depend on it. `--only NAME` (repeatable) limits either step to some fixtures,
so that adding one leaves the others' files untouched.

Every reference also holds LONG (LONG_TOKENS tokens or more) under `long/`, recorded with llama.cpp's
n_ctx at LONG_CONTEXT and kept at every LONG_STRIDE-th position only (the logits of all of them
would weigh megabytes): `python scripts/make_arch_fixtures.py long` adds it to the references
there are, from the fixtures as they are, without converting or quantizing anything again.

Qwen3 and Gemma 3 normalize Q and K per head, so scaling their Q/K weights would not make attention
peaked; their Q/K norm weights are set large instead (QK_NORM_GAIN), so that a wrong window,
RoPE base or mask changes the logits well past the tests' bars.

`split-convert` (the converter's Python, after `convert`) and `split-record` (the reference's) make
tests/fixtures/split/: the Qwen2 YaRN model converted to Q8_0 by the converter in parts of at
most ten tensors, as large published models come, and llama.cpp's reference for it. Not larger: llama.cpp keeps K and V
in float16, and with scores of ~50 (a gain of 4) that rounding alone moved its logits by a KL of 2e-3.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB_DIR = ROOT.parent / "shared" / "fixtures" / "vocab"
TEMPLATES = ROOT / "templates"
FIXTURES = ROOT / "tests" / "fixtures"
REFERENCES = ROOT / "tests" / "reference" / "arch"
SEED = 1234
# Normal tokens kept from each vocabulary: the byte alphabet and the commonest merges.
KEPT_TOKENS = 3000
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# Gemma 3's pattern is five sliding layers, then a global one: six layers hold one of each kind.
GEMMA3_LAYERS, GEMMA3_WINDOW = 6, 32
QK_NORM_GAIN = 2.0
# The MoE fixtures' experts, experts used a token, and the gain on their experts' initial weights.
# Routers keep transformers' initialization: near-even weights, so that renormalizing the chosen
# experts' weights matters (more peaked routers hide it, and make near-ties that flip experts).
MOE_EXPERTS, MOE_USED, MOE_EXPERT_GAIN = 4, 2, 2.0
LONG_TOKENS, LONG_CONTEXT, LONG_STRIDE = 4096, 8192, 64
# Large enough that the logits are peaked (clear argmaxes to compare), small enough to stay finite.
INIT_STD = 0.06

PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                 "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
# name -> vocabulary, special tokens kept (in order, after the normal ones), chat template, llama.cpp file type;
# Phi-3: the trained and original (LongRoPE) context lengths, and the llama.cpp contexts to record PASSAGE at.
FIXTURE_SPECS = {
    "llama3-tiny-Q6_K": dict(
        vocab="llama-bpe", template="llama3", ftype="Q6_K",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "qwen2-tiny-Q8_0": dict(
        vocab="qwen2", template="chatml", ftype="Q8_0",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>"),
    "phi3-tiny-Q5_K_M": dict(
        vocab="phi-3", template="phi3", ftype="Q5_K_M", specials=PHI3_SPECIALS, bos="<s>", eos="<|endoftext|>",
        context=131072, original_context=4096),
    # A small original context, so that llama.cpp's short factors (n_ctx 256) and long ones (its
    # default n_ctx, the trained 4096) can both be recorded for one passage.
    "phi3-longrope-tiny-Q8_0": dict(
        vocab="phi-3", template="phi3", ftype="Q8_0", specials=PHI3_SPECIALS, bos="<s>", eos="<|endoftext|>",
        context=4096, original_context=256, contexts=(256, 0)),
    # Mistral 7B v0.2/v0.3 (converted to `llama`): GQA, RoPE theta 1e6, no sliding window, v0.2's
    # template. Mistral's own vocabulary is not among the shared vocab files, so Llama 2's (llama-spm)
    # stands in: a SentencePiece model of the same kind (BPE, byte fallback, <unk> <s> </s> at 0-2).
    # Q4_K_M: the mix most published Mistral GGUFs use, and one the other fixtures do not cover.
    "mistral-tiny-Q4_K_M": dict(
        vocab="llama-spm", template="mistral", ftype="Q4_K_M", specials=[], bos="<s>", eos="</s>"),
    # Qwen2.5's long-context files: YaRN, factor 4 over an original 4,096 positions (16,384 in all).
    "qwen2-yarn-tiny-Q8_0": dict(
        vocab="qwen2", template="chatml", ftype="Q8_0",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>"),
    # Qwen3: Q/K norms, a head size (128) other than hidden / heads (64), theta 1e6, tied output, and
    # Qwen3-0.6B's own template (enable_thinking) from the shared templates.
    "qwen3-tiny-Q4_K_M": dict(
        vocab="qwen2", template="shared:Qwen-Qwen3-0.6B", ftype="Q4_K_M",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], bos=None,
        eos="<|im_end|>", exact_reference=True),
    # Gemma 3: six layers, five sliding over a window of 32 positions (shorter than the prompts) with
    # RoPE base 10,000, one global with 1e6; 4 query heads and 1 KV head of 64; GeGLU; post norms.
    # Gemma's own vocabulary is not among the shared files: Llama 2's SentencePiece stands in, which
    # the converter marks as Gemma's (no space prefix).
    "gemma3-tiny-Q8_0": dict(
        vocab="llama-spm", template="gemma", ftype="Q8_0", specials=["<start_of_turn>", "<end_of_turn>"],
        bos="<s>", eos="</s>", exact_reference=True),
    # Mixture-of-experts: Qwen3-30B-A3B's layout (`qwen3moe`: Q/K norms, a softmax router whose top-k
    # weights are renormalized) and Mixtral's (`llama` with experts); four experts, two used. Q8_0
    # keeps Qwen3-MoE's native weights exact (its scales are the file's float16): a K-quant's
    # float16 scales rounding, with its Q/K norms' peaked attention, swapped experts at near-ties.
    "qwen3moe-tiny-Q8_0": dict(
        vocab="qwen2", template="chatml", ftype="Q8_0",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>", exact_reference=True),
    "mixtral-tiny-Q4_K_M": dict(
        vocab="llama-spm", template="mistral", ftype="Q4_K_M", specials=[], bos="<s>", eos="</s>",
        exact_reference=True),
}
# Vocabularies built as a SentencePiece tokenizer.model; the others as a byte-level BPE tokenizer.json.
SPM_VOCABS = ("phi-3", "llama-spm")
QUESTION = "What is the capital of Japan?"
PLAIN = "The capital of Italy is Rome. It's 2024: naïve café, 東京 and 🦙 — isn't it 3.14?"
PROMPTS = {
    "llama3-tiny-Q6_K": {
        "chat": "<|start_header_id|>user<|end_header_id|>\n\n" + QUESTION  # llama.cpp adds the BOS
                + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "plain": PLAIN,
    },
    "qwen2-tiny-Q8_0": {
        "chat": f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
        "plain": PLAIN,
    },
    "phi3-tiny-Q5_K_M": {
        "chat": f"<|user|>\n{QUESTION}<|end|>\n<|assistant|>\n",
        "plain": PLAIN,
    },
}
PROMPTS["phi3-longrope-tiny-Q8_0"] = PROMPTS["phi3-tiny-Q5_K_M"]
PROMPTS["qwen3-tiny-Q4_K_M"] = PROMPTS["qwen2-yarn-tiny-Q8_0"] = PROMPTS["qwen2-tiny-Q8_0"]
PROMPTS["gemma3-tiny-Q8_0"] = {
    "chat": f"<start_of_turn>user\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n",  # llama.cpp adds the BOS
    "plain": PLAIN,
}
PROMPTS["qwen3moe-tiny-Q8_0"] = PROMPTS["qwen2-tiny-Q8_0"]
PROMPTS["mixtral-tiny-Q4_K_M"] = PROMPTS["mistral-tiny-Q4_K_M"] = {
    "chat": f"[INST] {QUESTION} [/INST]",  # llama.cpp adds the BOS
    "plain": PLAIN,
}
# About 210 tokens: with its greedy continuation it fits the 256-token context of the short factors.
PASSAGE = ("The old harbour town wakes before the sun. Fishing boats come back with the tide, and the market "
           "fills with crates of sardines, crabs and silver mackerel. By eight the bakers have sold most of their "
           "bread, the cafes put their chairs out on the square, and the first buses climb the hill to the "
           "school. In summer the town doubles in size: visitors walk the sea wall, swim off the rocks below the "
           "lighthouse and eat grilled fish at long tables by the water. In winter the storms arrive from the "
           "west, the ferries stop for days at a time, and the people who stay mend nets, paint boats and wait "
           "for spring.")

# The passage and the capital questions in turn, to LONG_TOKENS tokens and more in every vocabulary here.
LONG = " ".join([PASSAGE, PLAIN] * 17)


# ---- convert (torch, transformers, llama.cpp's converter) ----------------------------------------

def chat_template(spec: dict) -> str:
    name = spec["template"]
    if name.startswith("shared:"):
        return (ROOT.parent / "shared" / "fixtures" / "templates" / f"{name[7:]}.jinja").read_text()
    return (TEMPLATES / f"{name}.jinja").read_text()


def read_vocab(name: str) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(VOCAB_DIR / f"ggml-vocab-{name}.gguf")
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def bpe_tokenizer(spec: dict, out: Path) -> int:
    """tokenizer.json and tokenizer_config.json: the vocabulary's first tokens, the merges among them, its specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = read_vocab(spec["vocab"])
    tokens, types = vocab["tokenizer.ggml.tokens"], vocab["tokenizer.ggml.token_type"]
    kept = [t for i, t in enumerate(tokens[:KEPT_TOKENS]) if types[i] == 1]
    kept_set = set(kept)
    merges = []
    for merge in vocab["tokenizer.ggml.merges"]:
        left, right = merge.split(" ", 1)
        if left in kept_set and right in kept_set and left + right in kept_set:
            merges.append((left, right))
    llama3 = spec["vocab"] == "llama-bpe"
    model = models.BPE(vocab={t: i for i, t in enumerate(kept)}, merges=merges, ignore_merges=llama3)
    tokenizer = Tokenizer(model)
    digits = r"\p{N}{1,3}" if llama3 else r"\p{N}"
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits
               + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec["bos"],
        "eos_token": spec["eos"],
        "chat_template": chat_template(spec),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    return len(kept) + len(spec["specials"])


def spm_tokenizer(spec: dict, out: Path) -> int:
    """tokenizer.model (the vocabulary's first pieces, byte fallback) and its added tokens in tokenizer_config.json."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    vocab = read_vocab(spec["vocab"])
    tokens, scores, types = (vocab[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    proto = sp_pb2.ModelProto()
    for text, score, kind in zip(tokens[:KEPT_TOKENS], scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = text, score, kind
    proto.trainer_spec.model_type = sp_pb2.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = KEPT_TOKENS
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
    proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    proto.normalizer_spec.remove_extra_whitespaces = False
    (out / "tokenizer.model").write_bytes(proto.SerializeToString())
    original_type = {t: types[i] for i, t in enumerate(tokens)}
    added = {
        str(KEPT_TOKENS + i): {"content": t, "special": original_type.get(t, 3) == 3, "normalized": False,
                               "lstrip": False, "rstrip": False, "single_word": False}
        for i, t in enumerate(spec["specials"])
    }
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": spec["bos"],
        "eos_token": spec["eos"],
        "unk_token": "<unk>",
        "added_tokens_decoder": added,
        "chat_template": chat_template(spec),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    return KEPT_TOKENS + len(spec["specials"])


def hf_model(name: str, spec: dict, vocab_size: int, token_ids: dict):
    import torch
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(SHAPE, vocab_size=vocab_size, initializer_range=INIT_STD, **token_ids)
    if name.startswith("llama3"):
        # Llama 3.2's RoPE: theta 500000 with llama3 scaling, which the converter turns into rope_freqs.
        config = LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})
        model = LlamaForCausalLM(config)
    elif name.startswith("qwen2-yarn"):
        config = Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=16384,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 4096})
        model = Qwen2ForCausalLM(config)
    elif name.startswith("qwen2"):
        config = Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = Qwen2ForCausalLM(config)
    elif name.startswith("qwen3moe"):
        config = Qwen3MoeConfig(**common, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                max_position_embeddings=40960, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_USED,
                                moe_intermediate_size=SHAPE["intermediate_size"] // 2, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[],
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = Qwen3MoeForCausalLM(config)
    elif name.startswith("mixtral"):
        config = MixtralConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=32768,
                               sliding_window=None, num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_USED,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = MixtralForCausalLM(config)
    elif name.startswith("qwen3"):
        config = Qwen3Config(**common, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = Qwen3ForCausalLM(config)
    elif name.startswith("gemma3"):
        shape = dict(common, num_hidden_layers=GEMMA3_LAYERS, num_key_value_heads=1)
        config = Gemma3TextConfig(
            **shape, head_dim=64, query_pre_attn_scalar=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=32768, sliding_window=GEMMA3_WINDOW, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        model = Gemma3ForCausalLM(config)
    elif name.startswith("mistral"):
        # Mistral 7B v0.2/v0.3: theta 1e6 and no sliding window (v0.1's 4096 window is gone).
        config = MistralConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=32768,
                               sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = MistralForCausalLM(config)
    else:
        # Phi-3-mini-128k's LongRoPE: short/long factors per rotated pair, and an attention factor.
        half = SHAPE["hidden_size"] // SHAPE["num_attention_heads"] // 2
        gen = torch.Generator().manual_seed(SEED)
        short = (1.0 + 2.0 * torch.rand(half, generator=gen)).tolist()
        long = (1.0 + 20.0 * torch.rand(half, generator=gen)).tolist()
        original = spec["original_context"]
        config = Phi3Config(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                            max_position_embeddings=spec["context"], original_max_position_embeddings=original,
                            pad_token_id=None,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                             "long_factor": long, "original_max_position_embeddings": original})
        model = Phi3ForCausalLM(config)
    # transformers starts biases at 0 and norms at 1, which would leave them untested. Gemma's norms
    # multiply by 1 + weight.
    shift = 1.0 if name.startswith("gemma") else 0.0
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "q_norm" in pname or "k_norm" in pname:
                param.copy_(QK_NORM_GAIN - shift + 0.2 * torch.randn_like(param))
            elif "norm" in pname:
                param.copy_(1.0 - shift + 0.2 * torch.randn_like(param))
            elif "experts" in pname:  # so that which experts run shows in the logits well past the bars
                param.mul_(MOE_EXPERT_GAIN)
    return model


def converter(llama_cpp: str):
    """llama.cpp's convert_hf_to_gguf module from its source tree, imported before anything else
    reads a GGUF, so that `gguf` is the tree's own gguf-py."""
    root = Path(llama_cpp).resolve()
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import convert_hf_to_gguf

    return convert_hf_to_gguf


def pin_pre_tokenizer(vocab: str) -> None:
    """A cut-down vocabulary cannot match the converter's hash of a full one: pin `vocab`'s name."""
    from conversion import base

    pre = read_vocab(vocab).get("tokenizer.ggml.pre", "default")
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=pre: pre


def convert(args) -> None:
    import torch

    convert_hf_to_gguf = converter(args.llama_cpp)
    work = Path(args.work)
    for name, spec in selected(args):
        torch.manual_seed(SEED)
        out = work / name.rsplit("-", 1)[0]  # the directory name becomes general.name (phi3 needs "phi3" in it)
        out.mkdir(parents=True, exist_ok=True)
        make_tokenizer = spm_tokenizer if spec["vocab"] in SPM_VOCABS else bpe_tokenizer
        n_vocab = make_tokenizer(spec, out)
        first_special = n_vocab - len(spec["specials"])
        # An added special's id follows the kept pieces; a kept one (SentencePiece's <s>, </s>) keeps its own.
        tokens = read_vocab(spec["vocab"])["tokenizer.ggml.tokens"]
        ids = {f"{k}_token_id": first_special + spec["specials"].index(spec[k]) if spec[k] in spec["specials"]
               else tokens.index(spec[k]) for k in ("bos", "eos") if spec[k] is not None}
        hf_model(name, spec, n_vocab, ids).save_pretrained(out)
        pin_pre_tokenizer(spec["vocab"])
        sys.argv = ["convert_hf_to_gguf.py", str(out), "--outtype", "f32", "--outfile", str(work / f"{name}-F32.gguf")]
        convert_hf_to_gguf.main()


# ---- quantize and record (llama-cpp-python) -----------------------------------------------------

def quantize(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import llama_cpp
    import numpy as np
    from make_llama_reference import reference  # also switches off llama.cpp's extra buffer types

    work = Path(args.work)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    REFERENCES.mkdir(parents=True, exist_ok=True)
    for name, spec in selected(args):
        target = FIXTURES / f"{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{spec['ftype']}")
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(work / f"{name}-F32.gguf").encode(), str(target).encode(), params) != 0:
            raise SystemExit(f"quantizing {name} failed")
        # llama.cpp's quantized path rounds activations to 8 bits: with attention as peaked as these
        # fixtures' that alone moved its logits by a mean KL of 1e-3 to 3e-3, while on a float32 copy
        # of the same dequantized weights it agrees with us to 1e-5. The newer fixtures' references
        # are llama.cpp on that copy: the exact answer for the file's weights.
        source = dequantized_copy(target, work) if spec.get("exact_reference") else target
        record = reference(source, PROMPTS[name])
        for prompt, text in PROMPTS[name].items():
            record[f"{prompt}/text"] = np.array(text)
        for n_ctx in spec.get("contexts", ()):
            record.update({f"ctx{n_ctx}/{k}": v for k, v in reference(target, {"passage": PASSAGE}, n_ctx).items()})
        record.update(long_record(source))
        np.savez_compressed(REFERENCES / f"{name}.npz", **record)
        print(name, target.stat().st_size, {k: record[k].tolist() for k in record if k.endswith("greedy")})


def dequantized_copy(target: Path, work: Path) -> Path:
    """The quantized file with every tensor dequantized to float32, by llama.cpp's quantizer."""
    import llama_cpp

    copy = work / f"{target.stem}-dequantized-F32.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_ALL_F32, True, 2
    if llama_cpp.llama_model_quantize(str(target).encode(), str(copy).encode(), params) != 0:
        raise SystemExit(f"dequantizing {target.name} failed")
    return copy


def long_record(target: Path) -> dict:
    """LONG's record at LONG_CONTEXT, at every LONG_STRIDE-th position and the last."""
    import numpy as np
    from make_llama_reference import keep_every, reference

    record = keep_every(reference(target, {"long": LONG}, LONG_CONTEXT), "long", LONG_STRIDE, LONG_TOKENS)
    record["long/text"] = np.array(LONG)
    return record


SPLIT = "qwen2-split-tiny-Q8_0"
SPLIT_DIR = FIXTURES / "split"


def split_convert(args) -> None:
    """The Qwen2 YaRN fixture's transformers model (made by `convert`) converted again to Q8_0 by
    llama.cpp's converter, split in parts of at most 10 tensors: tests/fixtures/split/."""
    convert_hf_to_gguf = converter(args.llama_cpp)
    pin_pre_tokenizer("qwen2")
    SPLIT_DIR.mkdir(parents=True, exist_ok=True)
    sys.argv = ["convert_hf_to_gguf.py", str(Path(args.work) / "qwen2-yarn-tiny"), "--outtype", "q8_0",
                "--split-max-tensors", "10", "--outfile", str(SPLIT_DIR / f"{SPLIT}.gguf")]
    convert_hf_to_gguf.main()


def split_record(args) -> None:
    """llama.cpp's reference for the split model, opened from its first part."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from make_llama_reference import reference

    first = sorted(SPLIT_DIR.glob(f"{SPLIT}-00001-of-*.gguf"))[0]
    record = reference(first, PROMPTS["qwen2-tiny-Q8_0"])
    for prompt, text in PROMPTS["qwen2-tiny-Q8_0"].items():
        record[f"{prompt}/text"] = np.array(text)
    (ROOT / "tests" / "reference" / "split").mkdir(parents=True, exist_ok=True)
    np.savez_compressed(ROOT / "tests" / "reference" / "split" / f"{SPLIT}.npz", **record)
    print(first.name, {k: record[k].tolist() for k in record if k.endswith("greedy")})


def add_long(args) -> None:
    """LONG's record added to each reference there is, from its fixture as it is."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for name, spec in selected(args):
        path = REFERENCES / f"{name}.npz"
        with np.load(path) as data:
            record = {key: data[key] for key in data.files if not key.startswith("long/")}
        target = FIXTURES / f"{name}.gguf"
        record.update(long_record(dequantized_copy(target, work) if spec.get("exact_reference") else target))
        np.savez_compressed(path, **record)
        print(name, len(record["long/ids"]), "tokens,", len(record["long/positions"]), "positions kept")


def selected(args) -> list:
    unknown = set(args.only or ()) - FIXTURE_SPECS.keys()
    if unknown:
        raise SystemExit(f"no such fixture: {', '.join(sorted(unknown))}")
    return [(name, spec) for name, spec in FIXTURE_SPECS.items() if not args.only or name in args.only]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    conv = sub.add_parser("convert")
    conv.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    conv.add_argument("--work", default="/tmp/mlxllama-arch")
    quant = sub.add_parser("quantize")
    quant.add_argument("--work", default="/tmp/mlxllama-arch")
    long = sub.add_parser("long")
    long.add_argument("--work", default="/tmp/mlxllama-arch")
    for step in (conv, quant, long):
        step.add_argument("--only", action="append", metavar="NAME", help="this fixture only (repeatable)")
    split = sub.add_parser("split-convert")
    split.add_argument("--llama-cpp", required=True)
    split.add_argument("--work", default="/tmp/mlxllama-arch")
    sub.add_parser("split-record")
    args = parser.parse_args()
    steps = {"convert": convert, "quantize": quantize, "long": add_long, "split-convert": split_convert,
             "split-record": split_record}
    steps[args.step](args)


if __name__ == "__main__":
    main()
