"""The embedded default model: what `kvcalib calibrate` calibrates when no --model is given.

Why it exists: a newcomer should see a full calibration run (load, observe K/V, compute scales, export a
checkpoint vLLM loads) within a minute, with no hub access and no multi-gigabyte download. So the project
ships only text (`data/sample_text.jsonl`) and builds a tiny Llama from it on first use.

Why it is trained rather than random: KV-cache calibration is about the distribution of keys and values.
Randomly initialised weights give near-Gaussian activations with no structure, so every layer gets the
same unremarkable scale. Even a short training run on real text produces what real models show:
per-channel outliers in the keys, layers whose ranges differ by a large factor, a BOS token that
attracts attention. Those are exactly what per-layer scales exist for, so the demo exercises them.

Shape constraints: head_dim is 64 because vLLM's CPU FP8 KV cache needs head_dim divisible by 32; two KV
heads for four query heads so grouped-query attention is covered. Training is capped by a step count, not
by wall-clock time, so the same inputs give the same model. The result is cached in `build_dir`, keyed
by a hash of the data bytes and every hyperparameter, and written to a temporary sibling directory that
is renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BUILD_VERSION = 1
DIR_NAME = "default-model"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"

TOKENIZER = {"vocab_size": 4096, "min_frequency": 2}
MODEL = {
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
# Small batches win at this budget: 400 steps of 2x256 tokens (~200k tokens, ~5 passes over the data)
# reach a far lower loss than 100 steps of 8x256 for the same compute, about a minute on two CPU cores.
TRAIN = {
    "seed": 0, "seq_len": 256, "batch_size": 2, "steps": 400, "warmup_steps": 40, "lr": 2.5e-3,
    "min_lr_ratio": 0.1, "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0, "log_every": 50,
}
# Role-tagged turns, each closed by EOS; BOS comes from the template, not from the tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

Log = Callable[[str], Any]


def ensure_default_model(build_dir: Path, data_file: Path, *, log: Log = print) -> Path:
    """Return `build_dir/default-model`, building it first unless a complete build of the same inputs exists."""
    build_dir, data_file = Path(build_dir), Path(data_file)
    target = build_dir / DIR_NAME
    key = _build_key(data_file)
    if _cached_key(target) == key:
        return target
    log(f"default model: building into {target} (one time; trains a small Llama on {data_file.name})")
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}-", dir=build_dir))
    tmp.chmod(0o755)
    try:
        info = _build(tmp, _read_texts(data_file), log)
        (tmp / "build_info.json").write_text(json.dumps({"key": key, **info}, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_key(data_file: Path) -> str:
    params = {"version": BUILD_VERSION, "tokenizer": TOKENIZER, "model": MODEL, "train": TRAIN,
              "chat_template": CHAT_TEMPLATE}
    digest = hashlib.sha256(data_file.read_bytes())
    digest.update(json.dumps(params, sort_keys=True).encode())
    return digest.hexdigest()


def _cached_key(target: Path) -> str | None:
    if not all((target / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return None
    try:
        return json.loads((target / "build_info.json").read_text()).get("key")
    except (OSError, ValueError):
        return None


def _read_texts(data_file: Path) -> list[str]:
    texts = [json.loads(line)["text"] for line in data_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{data_file}: no text records to train the default model on")
    return texts


def _build(out: Path, texts: list[str], log: Log) -> dict[str, Any]:
    tokenizer = _train_tokenizer(texts)
    tokenizer.save_pretrained(out)
    return _train_model(out, texts, tokenizer, log)


def _train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER["vocab_size"], min_frequency=TOKENIZER["min_frequency"],
                                  special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=MODEL["max_position_embeddings"])


def _train_model(out: Path, texts: list[str], tokenizer: Any, log: Log) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = TRAIN
    ids = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    shape = {k: v for k, v in MODEL.items() if k != "rope_theta"}
    config = LlamaConfig(**shape, vocab_size=len(tokenizer), rope_parameters={
        "rope_type": "default", "rope_theta": MODEL["rope_theta"]},
        bos_token_id=ids[0], eos_token_id=ids[1], pad_token_id=ids[2])

    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    n_chunks = len(stream) // cfg["seq_len"]
    chunks = torch.tensor(stream[: n_chunks * cfg["seq_len"]]).view(n_chunks, cfg["seq_len"])

    torch.manual_seed(cfg["seed"])
    model = LlamaForCausalLM(config).float().train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                               {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"], betas=cfg["betas"])
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_factor)
    gen = torch.Generator().manual_seed(cfg["seed"])
    log(f"default model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(stream)} training tokens, {cfg['steps']} steps of {cfg['batch_size']}x{cfg['seq_len']}")

    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        batch = chunks[torch.randint(n_chunks, (cfg["batch_size"],), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optim.step()
        sched.step()
        losses.append(loss.item())
        if step == 1 or step % cfg["log_every"] == 0 or step == cfg["steps"]:
            log(f"default model: step {step}/{cfg['steps']} loss {losses[-1]:.3f}")
    seconds = time.perf_counter() - start
    log(f"default model: trained in {seconds:.0f}s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")

    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=ids[0], eos_token_id=ids[1], pad_token_id=ids[2])
    model.to(torch.bfloat16).eval().save_pretrained(out, safe_serialization=True)
    return {"steps": cfg["steps"], "first_loss": losses[0], "final_loss": losses[-1],
            "train_seconds": round(seconds, 1), "train_tokens": len(stream)}


def _lr_factor(step: int) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak learning rate."""
    warmup, total, floor = TRAIN["warmup_steps"], TRAIN["steps"], TRAIN["min_lr_ratio"]
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
