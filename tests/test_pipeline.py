"""End to end on CPU: pre-tokenized data through a tokenizer-less float32 Llama to exported scales."""

import json

import pytest
import torch
from safetensors import safe_open

from calib import pipeline
from calib.capture.spec import capture_spec
from calib.recipe.recipe import Recipe
from tiny import tiny_causal_lm
from helpers import reference_amax, used_sequences


def test_scales_equal_amax_over_exactly_the_tokens_used(tiny_llama_dir, token_data, tmp_path):
    recipe = Recipe(samples=10, seq_len=24, min_tokens=12, batch_size=3, seed=5)
    res = pipeline.calibrate(tiny_llama_dir, token_data, recipe, tmp_path / "out", device="cpu")
    assert res.model_dtype == "float32"
    seqs, rep = used_sequences(token_data, recipe, 257)
    assert res.data.to_dict() == rep.to_dict() and rep.used == 10
    ref = reference_amax(tiny_causal_lm("llama"), seqs)  # same seed → same weights as the saved model
    with safe_open(tmp_path / "out" / "kv_scales.safetensors", "pt") as f:
        for i, (k_amax, v_amax) in ref.items():
            k = f.get_tensor(f"model.layers.{i}.self_attn.k_scale")
            v = f.get_tensor(f"model.layers.{i}.self_attn.v_scale")
            assert float(k) == pytest.approx(float(k_amax.max()) / 448, rel=1e-3)
            assert float(v) == pytest.approx(float(v_amax.max()) / 448, rel=1e-3)
    prov = json.loads((tmp_path / "out" / "kvcalib.json").read_text())
    assert prov["data"]["tokens"] == sum(map(len, seqs))
    assert prov["recipe"]["seed"] == 5 and prov["layers"]["0"]["k_scale"] == pytest.approx(float(ref[0][0].max()) / 448, rel=1e-6)


def test_observe_kv_returns_its_capture(tiny_llama_dir, token_data):
    """The capture stage hands its result on: the merged capture, its statistics, the loop's seconds."""
    from calib.model import load as model_mod
    recipe = Recipe(samples=6, seq_len=24, min_tokens=12, batch_size=2, seed=3)
    seqs, _ = used_sequences(token_data, recipe, 257)
    loaded = model_mod.load(tiny_llama_dir, device="cpu")
    seen = pipeline.observe_kv(loaded, seqs, recipe.batch_size, spec=capture_spec(recipe, loaded.config))
    assert seen.seconds > 0 and sorted(seen.stats) == sorted(seen.capture.stats())
    ref = reference_amax(tiny_causal_lm("llama"), seqs)
    for i, (k_amax, v_amax) in ref.items():
        torch.testing.assert_close(seen.stats[i].k_amax, k_amax, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(seen.capture.stats()[i].v_amax, v_amax, rtol=1e-4, atol=1e-6)


def test_provenance_of_a_calibrate_run_is_complete(tiny_llama_dir, token_data, tmp_path):
    """kvcalib.json holds every field of the run as written, rotary_dim and --into included, none patched in
    later: `provenance` alone, given its inputs, builds the same record."""
    from calib.ckpt.names import PROVENANCE_FILE
    from calib.model import load as model_mod
    recipe = Recipe(samples=4, seq_len=24, min_tokens=12, batch_size=2, seed=1)
    res = pipeline.calibrate(tiny_llama_dir, token_data, recipe, tmp_path / "a", device="cpu")
    written = json.loads((res.out / PROVENANCE_FILE).read_text())
    fields = {"producer", "created", "model", "data", "recipe", "skipped_layers", "calibration_dtype", "versions",
              "layers", "rotary_dim"}
    assert fields <= set(written) and "into" not in written and "selected_by" not in written
    config = model_mod.read_config(tiny_llama_dir)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert written["rotary_dim"] == head_dim                   # the tiny Llama rotates the whole head
    assert written["recipe"] == recipe.to_dict() and written["data"]["tokens"] == res.data.tokens
    built = pipeline.provenance(recipe, str(tiny_llama_dir), pipeline.data_record(token_data, res.data), res.stats,
                                res.scales, res.skipped, res.model_dtype, rotary_dim=head_dim, into="q").to_dict()
    assert {k for k in built if k != "into"} == fields and built["into"] == "q"
    same = fields - {"created"}                                # the export adds its own (target, weights)
    assert {k: built[k] for k in same} == {k: written[k] for k in same}


def test_a_calibrate_job_runs_the_same_as_calibrate(tiny_llama_dir, token_data, tmp_path):
    """The CLI's frozen job object and `calibrate`'s keyword form drive the same stages to the same output."""
    import dataclasses
    recipe = Recipe(samples=5, seq_len=24, min_tokens=12, batch_size=2, seed=2)
    job = pipeline.CalibrateJob(tiny_llama_dir, token_data, recipe, tmp_path / "job", device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.force = True
    a = pipeline.run(job)
    b = pipeline.calibrate(tiny_llama_dir, token_data, recipe, tmp_path / "kw", device="cpu")
    assert a.out == tmp_path / "job" and a.data.to_dict() == b.data.to_dict() and sorted(a.scales) == sorted(b.scales)
    for i in a.scales:
        assert torch.equal(a.scales[i].k_scale, b.scales[i].k_scale) and torch.equal(a.scales[i].v_scale, b.scales[i].v_scale)
    # same tensors, bytes and metadata (not the raw file: safetensors orders its metadata keys arbitrarily)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "job" / "kv_scales.safetensors"), "pt") as fa, \
            safe_open(str(tmp_path / "kw" / "kv_scales.safetensors"), "pt") as fb:
        assert fa.metadata() == fb.metadata() and sorted(fa.keys()) == sorted(fb.keys())
        for name in fa.keys():
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
            assert ta.dtype == tb.dtype and ta.shape == tb.shape and ta.numpy().tobytes() == tb.numpy().tobytes()


def test_same_inputs_give_the_same_scales_across_batch_sizes(tiny_llama_dir, token_data, tmp_path):
    """Same data, batch 1 vs 5: equal up to float32 GEMM blocking (batched matmuls round differently)."""
    outs = []
    for bs in (1, 5):
        r = Recipe(samples=12, seq_len=32, min_tokens=8, batch_size=bs)
        outs.append(pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / f"o{bs}", device="cpu").scales)
    for i in outs[0]:
        torch.testing.assert_close(outs[0][i].k_scale, outs[1][i].k_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(outs[0][i].v_scale, outs[1][i].v_scale, rtol=1e-6, atol=0)


def test_seq_len_beyond_context_is_refused_before_running(tiny_llama_dir, token_data, tmp_path):
    from calib.model.load import ModelError
    with pytest.raises(ModelError, match="max_position_embeddings = 256"):
        pipeline.calibrate(tiny_llama_dir, token_data, Recipe(seq_len=1024), tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()


def test_seq_len_beyond_context_is_refused_before_any_weight_loads(tiny_llama_dir, token_data, tmp_path, monkeypatch):
    """The context check is one of the checks (config.json only): on a 70B model a load takes minutes."""
    from calib.model import load as model_mod

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the context check")
    monkeypatch.setattr(model_mod, "load", no_load)
    job = pipeline.CalibrateJob(tiny_llama_dir, token_data, Recipe(seq_len=1024), tmp_path / "out", device="cpu")
    with pytest.raises(model_mod.ModelError, match="seq_len 1024 exceeds the model's context"):
        pipeline.check_calibrate(job)


def test_the_checks_read_each_file_once_and_the_stages_take_what_they_read(tiny_llama_dir, token_data, tmp_path,
                                                                           monkeypatch):
    """One resolve, one preflight (one transformers config), one header scan per shard and one `prepare` per
    target for a whole calibrate run into two targets: the stages take the checks' values, never re-read."""
    from collections import Counter

    import transformers

    from calib import export
    from calib.ckpt import integrity
    from calib.model import load as model_mod

    calls: Counter = Counter()

    def counted(owner, name, key=None):
        orig = getattr(owner, name)

        def wrapper(*a, **k):
            calls[key or name] += 1
            return orig(*a, **k)
        monkeypatch.setattr(owner, name, wrapper)

    counted(model_mod, "resolve_source")
    counted(model_mod, "preflight")
    read_header = integrity.read_header
    monkeypatch.setattr(integrity, "read_header",
                        lambda path, *a, **k: (calls.update([f"header {path.name}"]), read_header(path, *a, **k))[1])
    for name, target in export.TARGETS.items():
        counted(target, "prepare", f"prepare {name}")
    auto_config = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: (calls.update(["AutoConfig"]), auto_config(*a, **k))[1])
    recipe = Recipe(samples=4, seq_len=24, min_tokens=12, batch_size=2, targets=("vllm", "trtllm"))
    res = pipeline.calibrate(tiny_llama_dir, token_data, recipe, tmp_path / "out", device="cpu")
    assert sorted(p.name for p in res.out.iterdir()) == [".kvcalib-output.json", "trtllm", "vllm"]
    assert dict(calls) == {"resolve_source": 1, "preflight": 1, "AutoConfig": 1, "header model.safetensors": 1,
                           "prepare vllm": 1, "prepare trtllm": 1}


def test_model_with_non_plain_kv_cache_is_refused(tmp_path, token_data):
    from calib.model.load import ModelError, check_cache_kind
    from transformers import DeepseekV3Config, LlamaConfig
    with pytest.raises(ModelError, match="latent"):
        check_cache_kind(DeepseekV3Config(), "MODEL x")
    cfg = LlamaConfig()
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ModelError, match="linear_attention"):
        check_cache_kind(cfg, "MODEL x")


def test_big_k_range_gives_scale_above_one(tmp_path, token_data):
    """A model whose K exceeds FP8's 448 (where the default scale 1.0 saturates) gets scale > 1."""
    src = tmp_path / "big"
    tiny_causal_lm("llama", scale_k=2000.0).save_pretrained(src)
    res = pipeline.calibrate(src, token_data, Recipe(samples=6, seq_len=32, min_tokens=8), tmp_path / "o", device="cpu")
    assert max(float(s.k_amax.max()) for s in res.scales.values()) > 448
    assert max(float(s.k_scale) for s in res.scales.values()) > 1.0


def test_check_calibrate_reads_every_field_from_the_job(tiny_llama_dir, token_data, tmp_path):
    """`check_calibrate` takes the job itself: a bad field of the job is a one-line error naming it, and a sound
    job comes back checked (model and output folders resolved) with nothing written."""
    import dataclasses
    from calib.safety import options as opts, outputs
    recipe = Recipe(samples=4, seq_len=24, min_tokens=12, batch_size=2)
    job = pipeline.CalibrateJob(tiny_llama_dir, token_data, recipe, tmp_path / "out", device="cpu")
    checked = pipeline.check_calibrate(job)
    assert checked.source_dir == checked.target_dir == tiny_llama_dir.resolve() and not (tmp_path / "out").exists()
    bad = [(dict(device="gpu0"), opts.OptionError, "'gpu0' is not a device name"),
           (dict(options=pipeline.RunOptions(max_batch_tokens=16)), opts.OptionError, "is below --seq-len 24"),
           (dict(stats_out=token_data), outputs.OutputError, "is the data"),
           (dict(out=tiny_llama_dir / "sub"), outputs.OutputError, "inside the model folder")]
    for change, error, message in bad:
        with pytest.raises(error, match=message):
            pipeline.check_calibrate(dataclasses.replace(job, **change))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["tiny-llama", "tokens.jsonl"])


def test_one_pass_with_several_captures_equals_one_pass_each(tiny_llama_dir, token_data):
    """observe_kv_each (what tune's single pass uses): every capture nested around one forward pass records
    bit for bit what a pass of its own records, for observers of different kinds."""
    from calib.model import load as model_mod
    recipe = Recipe(samples=8, seq_len=24, min_tokens=12, batch_size=3, seed=4)
    loaded = model_mod.load(tiny_llama_dir, device="cpu")
    specs = [capture_spec(recipe.replace(observer=o, q_scale=o == "absmax"), loaded.config)
             for o in ("absmax", "mse", "percentile")]
    seqs, report = pipeline.token_stream(token_data, loaded, recipe)
    together = pipeline.observe_kv_each(loaded, seqs, recipe.batch_size, specs)
    assert report.used == 8 and len({o.seconds for o in together}) == 1
    for spec, joint in zip(specs, together):
        alone = pipeline.observe_kv(loaded, pipeline.token_stream(token_data, loaded, recipe)[0], recipe.batch_size,
                                    spec=spec)
        assert sorted(joint.stats) == sorted(alone.stats)
        for i in alone.stats:
            for side in ("k", "v"):
                a, b = joint.stats[i].clip(side), alone.stats[i].clip(side)
                assert a.numpy().tobytes() == b.numpy().tobytes()
            assert (joint.stats[i].q_amax is None) == (alone.stats[i].q_amax is None)
    with pytest.raises(ValueError, match="one capture"):
        pipeline.observe_kv_each(loaded, seqs, 2, specs, options=pipeline.RunOptions(
            checkpoint=pipeline.Checkpointing(path=tiny_llama_dir / "r.safetensors", every=1)))
