"""The Flax Llama against transformers' LlamaForCausalLM, loaders, cache, generation, CLI."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

import dma_jax
from models.generate import Sampling, Timings, agreement, chat_prompt, generate, generate_batch, main, sample
from models.llama import AttentionSpec, KVCache, load_checkpoint, new_cache
from models.llama.loaders import embedded_model_path, load_gguf, load_hf

ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny_hf(tmp_path, *, tie=False, rope=None, shard=None, head_dim=16):
    cfg = HFConfig(vocab_size=300, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                   max_position_embeddings=512, rope_theta=500.0, tie_word_embeddings=tie, rope_scaling=rope)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path, **kwargs)
    return hf, str(tmp_path)


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.from_numpy(np.asarray(tokens))).logits.float().numpy()


@pytest.mark.parametrize("tie,rope,shard", [(False, ROPE_LLAMA3, None), (True, None, "60KB")])
def test_tiny_logits_equal_transformers(tmp_path, tie, rope, shard):
    hf, path = tiny_hf(tmp_path, tie=tie, rope=rope, shard=shard)
    if shard:
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model = load_hf(path)
    tokens = np.random.default_rng(0).integers(0, 300, (2, 150))
    ours, _ = model.prefill(jnp.asarray(tokens), None, AttentionSpec())
    ref = hf_logits(hf, tokens)
    assert np.abs(np.asarray(ours) - ref).max() < 1e-4
    assert (np.asarray(ours).argmax(-1) == ref.argmax(-1)).all()


def test_prefill_then_decode_equals_full_forward(tmp_path):
    _, path = tiny_hf(tmp_path, rope=ROPE_LLAMA3)
    model = load_hf(path)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 300, (1, 24)))
    full, _ = model.prefill(tokens, None, AttentionSpec())
    for decode in ("exact", "xla"):
        spec = AttentionSpec(decode=decode)
        logits, cache = model.prefill(tokens[:, :20], KVCache.empty(model.config, 1, 32), spec)
        steps = [logits[:, -1]]
        for i in range(20, 24):
            logits, cache = model.decode(tokens[:, i:i + 1], cache, spec)
            steps.append(logits[:, -1])
        assert cache.length.tolist() == [24]
        np.testing.assert_allclose(np.stack(steps[1:], 1), np.asarray(full[:, 20:]), atol=2e-5)


def test_batch_of_prompts_of_different_lengths_decodes_each_row_as_alone(tmp_path):
    """Right-padded rows: prefill with per-row lengths, then decode steps at per-row
    positions, give each row the logits of its own full forward (transformers')."""
    hf, path = tiny_hf(tmp_path, rope=ROPE_LLAMA3)
    model = load_hf(path)
    rng = np.random.default_rng(4)
    rows = [rng.integers(0, 300, n) for n in (9, 15, 12)]
    prompt_lens = [n - 3 for n in map(len, rows)]
    padded = np.zeros((3, max(prompt_lens)), np.int64)
    for r, (row, n) in enumerate(zip(rows, prompt_lens)):
        padded[r, :n] = row[:n]
    for decode in ("exact", "xla"):
        spec = AttentionSpec(decode=decode)
        last, cache = model.prefill(jnp.asarray(padded), KVCache.empty(model.config, 3, 16), spec,
                                    lengths=jnp.asarray(prompt_lens), last_only=True)
        got = [[np.asarray(last[r])] for r in range(3)]
        for i in range(3):
            step = jnp.asarray([[row[n + i]] for row, n in zip(rows, prompt_lens)])
            logits, cache = model.decode(step, cache, spec)
            for r in range(3):
                got[r].append(np.asarray(logits[r, 0]))
        assert cache.length.tolist() == [n + 3 for n in prompt_lens]
        for r, (row, n) in enumerate(zip(rows, prompt_lens)):
            want = hf_logits(hf, row[None])[0, n - 1:]
            np.testing.assert_allclose(np.stack(got[r]), want, atol=1e-4)


@pytest.mark.parametrize("kv_cache, decode_high", [("input", None), pytest.param("fp8", "bf16",
                                                                                 marks=pytest.mark.slow)])
def test_dma_decode_equals_full_forward_with_reference_last_row(tmp_path, kv_cache, decode_high):
    """Decode over the low-bit cache (rows of different lengths, one length shared by the
    layers) gives the logits of a full forward whose newest row attends through
    reference_attention on the whole sequence with the cache's config (``decode_high``
    in place of MXFP8) and fixed smooth-K mean (and
    V rounded to E4M3 per token for kv_cache="fp8"), every earlier row through exact
    attention (the prefill's)."""
    _, path = tiny_hf(tmp_path, head_dim=64)
    model = load_hf(path)
    rng = np.random.default_rng(5)
    lengths = [150, 131]
    tokens = jnp.asarray(rng.integers(0, 300, (2, 151)))
    spec = AttentionSpec(prefill="exact", decode="dma", dma=dma_jax.DMAConfig(diag_tiles=1, sink_tiles=0),
                         kv_cache=kv_cache, decode_high=decode_high)
    _, cache = model.prefill(tokens[:, :150], new_cache(model.config, spec, 2, 256), spec,
                             lengths=jnp.asarray(lengths), last_only=True)
    means = [layer.k_mean for layer in cache.layers]
    step = tokens[jnp.arange(2), jnp.asarray(lengths)][:, None]
    logits, cache = model.decode(step, cache, spec)
    assert cache.length.tolist() == [151, 132]
    # One length for all layers: each layer reads that array, and the pytree (what a
    # jitted step passes and donates) carries it once, also through jax.jit.
    per_layer = len(jax.tree.leaves(cache.layers[0]))
    for c in (cache, jax.jit(lambda c: c)(cache)):
        assert all(layer.length is c.length for layer in c.layers)
        assert len(jax.tree.leaves(c)) == len(c.layers) * (per_layer - 1) + 1
        assert c.length.tolist() == [151, 132]
    for r, n in enumerate(lengths):
        row = tokens[r:r + 1, :n + 1].at[0, n].set(step[r, 0])

        def attend(i, q, k, v, r=r, n=n):
            last_v = v
            if kv_cache == "fp8":
                last_v = dma_jax.formats.dequantize_token_e4m3(dma_jax.formats.quantize_token_e4m3(v)).astype(v.dtype)
            config = spec.cache_config(model.config.head_dim**-0.5)
            assert config.high == (decode_high or "mxfp8_e4m3")
            last = dma_jax.reference_attention(q[:, -1:], k, last_v, config=config, k_mean=means[i][r:r + 1])
            earlier = AttentionSpec().prefill_fn(q, k, v, sm_scale=model.config.head_dim**-0.5)
            return earlier.at[:, -1:].set(last)

        want = model.run_layers(row, jnp.arange(n + 1), attend)[0, -1]
        np.testing.assert_allclose(np.asarray(logits[r, 0]), np.asarray(want), atol=2e-4)


def test_dma_all_high_stays_close_to_exact(tmp_path):
    hf, path = tiny_hf(tmp_path, head_dim=64)
    model = load_hf(path)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 300, (1, 200)))
    exact, _ = model.prefill(tokens, None, AttentionSpec())

    def err(cfg):
        out, _ = model.prefill(tokens, None, AttentionSpec.named("dma", dma=cfg))
        return float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))

    high, low = err(dma_jax.DMAConfig.all_high()), err(dma_jax.DMAConfig.all_low())
    assert high < 0.02
    assert high < low


@pytest.fixture(scope="module")
def smollm():
    model, make_tokenizer = load_checkpoint(None)
    return model, make_tokenizer()


def test_smollm2_gguf_logits_equal_transformers(smollm):
    model, tokenizer = smollm
    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).eval()
    ids = chat_prompt(tokenizer, "Name three colours.")
    ours, _ = model.prefill(jnp.asarray([ids]), None, AttentionSpec())
    ref = hf_logits(hf, [ids])
    assert np.abs(np.asarray(ours) - ref).max() < 2e-3
    assert (np.asarray(ours).argmax(-1) == ref.argmax(-1)).all()


def test_greedy_answer_contains_paris(smollm):
    model, tokenizer = smollm
    ids = chat_prompt(tokenizer, "What is the capital of France?")
    out = list(generate(model, ids, spec=AttentionSpec.named("exact"), max_new_tokens=12,
                        stop_ids=(tokenizer.eos_token_id,)))
    assert "Paris" in tokenizer.decode(out)
    # A longer KV cache (shared by prompts of several lengths) changes nothing.
    longer = list(generate(model, ids, spec=AttentionSpec.named("exact"), max_new_tokens=12,
                           stop_ids=(tokenizer.eos_token_id,), cache_len=len(ids) + 40))
    assert longer == out
    # Decode steps run in chunks on the device: the answer is the same whatever the chunk,
    # including one that stops inside a chunk or one past the cache_len's positions.
    assert len(out) % 5
    for chunk in (1, 5):
        assert list(generate(model, ids, spec=AttentionSpec.named("exact"), max_new_tokens=12,
                             stop_ids=(tokenizer.eos_token_id,), chunk=chunk)) == out
    assert list(generate(model, ids, spec=AttentionSpec.named("exact"), max_new_tokens=4, chunk=2)) == out[:4]
    with pytest.raises(ValueError, match="chunk must be an int >= 1; got 0"):
        next(generate(model, ids, spec=AttentionSpec.named("exact"), max_new_tokens=4, chunk=0))
    with pytest.raises(ValueError, match=r"cache_len must be >= longest prompt \+ new tokens"):
        next(generate(model, ids, spec=AttentionSpec.named("exact"), max_new_tokens=12, cache_len=len(ids)))
    # A batch of two prompts of different lengths answers each as alone; the timings
    # count every row's prompt and the steps.
    other = chat_prompt(tokenizer, "Name three primary colors.")
    alone = list(generate(model, other, spec=AttentionSpec.named("exact"), max_new_tokens=12,
                          stop_ids=(tokenizer.eos_token_id,)))
    timings = Timings()
    steps = list(generate_batch(model, [ids, other], spec=AttentionSpec.named("exact"), max_new_tokens=12,
                                stop_ids=(tokenizer.eos_token_id,), timings=timings))
    assert [[s[r] for s in steps if s[r] is not None] for r in range(2)] == [out, alone]
    assert (timings.batch, timings.prompt_tokens, timings.new_tokens) == (2, len(ids) + len(other), len(steps))
    assert timings.compile_s > 0 and timings.prefill_s > 0 and timings.decode_tokens_per_s > 0
    # The same shapes again: compiled already.
    again = Timings()
    list(generate_batch(model, [ids, other], spec=AttentionSpec.named("exact"), max_new_tokens=12,
                        stop_ids=(tokenizer.eos_token_id,), timings=again))
    assert again.compile_s == 0


def test_sampling():
    logits = jnp.log(jnp.array([[0.05, 0.6, 0.3, 0.05]]))
    key = jax.random.PRNGKey(0)
    assert int(sample(logits, key, Sampling())[0]) == 1
    assert int(sample(logits, key, Sampling(temperature=1.0, top_p=0.1))[0]) == 1  # nucleus of one
    draws = {int(sample(logits, jax.random.PRNGKey(s), Sampling(temperature=1.0, top_p=0.85))[0]) for s in range(40)}
    assert draws == {1, 2}  # tokens outside the 0.85 nucleus never appear
    assert agreement([1, 2, 3], [1, 2, 4]) == (2 / 3, 2)
    assert agreement([1, 2], [1, 2]) == (1.0, None)
    assert agreement([1, 2], [1, 2, 3]) == (1.0, None)  # an early stop agrees as far as it goes
    assert agreement([1, 5], [1, 2, 3]) == (0.5, 1)
    # Frozen and validated: a compiled step is specialised to its sampling.
    assert hash(Sampling(0.7, 0.9)) == hash(Sampling(0.7, 0.9))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]; got 0"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="temperature must be >= 0; got -1"):
        Sampling(temperature=-1)


def test_cli_streams_and_compares(capsys):
    main(["--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "8",
          "--attention", "exact", "--compare"])
    out = capsys.readouterr().out
    assert "Paris" in out
    assert "8 new tokens" in out
    assert "[vs exact fp32 attention: 100.0% of generated tokens agree" in out
    assert "[vs bf16 jax.nn.dot_product_attention:" in out
    assert "exact attention's first token" in out and "in logit" in out


def test_first_token_margin_is_exact_attentions_top2_gap():
    """The margin the CLI reports is exact attention's top-2 logit gap, checked against
    the logits of a plain prefill of the prompt."""
    from models.generate import first_token_margin

    model, make_tokenizer = load_checkpoint(None)
    ids = make_tokenizer().encode("The capital of France is")
    top, second, margin = first_token_margin(model, ids)
    logits = np.asarray(model.prefill(jnp.asarray([ids]), None, AttentionSpec.named("exact"))[0][0, -1], np.float64)
    order = np.argsort(logits)[::-1]
    assert (top, second) == (order[0], order[1])
    assert abs(margin - (logits[order[0]] - logits[order[1]])) < 1e-4


@pytest.mark.slow
def test_cli_answers_several_prompts(capsys):
    main(["--chat", "--prompt", "What is the capital of France?", "--prompt", "Who wrote Romeo and Juliet?",
          "--max-new-tokens", "12", "--attention", "exact"])
    out = capsys.readouterr().out
    assert "> What is the capital of France?" in out and "> Who wrote Romeo and Juliet?" in out
    assert "Paris" in out and "Shakespeare" in out and out.count("new tokens;") == 2


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a directory nor a .gguf"):
        load_checkpoint(str(tmp_path / "missing.bin"))
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_gguf(str(tmp_path / "x.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(str(tmp_path))
    _, path = tiny_hf(tmp_path / "ok")
    weights = load_file(os.path.join(path, "model.safetensors"))

    def broken(change, message):
        d = tmp_path / message[:8].replace(" ", "_")
        d.mkdir()
        (d / "config.json").write_text(open(os.path.join(path, "config.json")).read())
        w = dict(weights)
        change(w)
        save_file(w, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            load_hf(str(d))

    name = "model.layers.1.mlp.up_proj.weight"
    broken(lambda w: w.__setitem__(name, w[name][:-1]), r"'model.layers.1.mlp.up_proj.weight' has shape \(95, 64\); expected \(96, 64\)")
    broken(lambda w: w.pop(name), r"lacks 1 tensors, e.g. \['layers.1.mlp.up_proj.kernel'\]")
    broken(lambda w: w.__setitem__("model.layers.0.extra.weight", w[name]), r"unknown tensor 'model.layers.0.extra.weight'")


def test_bad_attention_names_and_configs(tmp_path):
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        AttentionSpec.named("flash")
    with pytest.raises(ValueError, match=r"decode attention must be one of \('exact', 'xla', 'bf16', 'cudnn', 'dma'\); "
                                         r"got 'flash'"):
        AttentionSpec(prefill="dma", decode="flash")
    with pytest.raises(ValueError, match=r"kv_cache must be one of \('input', 'fp8'\); got 'int4'"):
        AttentionSpec(decode="dma", kv_cache="int4")
    with pytest.raises(ValueError, match=r"decode_high must be None or one of \('mxfp8_e4m3', 'mxfp8_e5m2', 'bf16'\)"):
        AttentionSpec(decode="dma", decode_high="nvfp4")
    with pytest.raises(ValueError, match="decode_high='bf16' is a format of DMA decode's cache: it needs decode='dma'"):
        AttentionSpec.named("dma", decode_high="bf16")
    x = jnp.zeros((1, 1, 2, 64))
    with pytest.raises(ValueError, match="decode='dma' reads a dma_jax.LowBitKVCache"):
        AttentionSpec(decode="dma").decode_fn(x, x, x, q_offset=0, kv_len=1, sm_scale=0.125)
    assert AttentionSpec.named("dma").decode == "exact"  # the paper's setting
    assert AttentionSpec.named("bf16").decode == "bf16"
    cfg = json.loads(open(tiny_hf(tmp_path)[1] + "/config.json").read())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    from models.llama import LlamaConfig

    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        LlamaConfig.from_hf(cfg)


def test_bf16_attention_is_plain_attention_on_bf16_inputs():
    """The "bf16" choice (what --compare sets beside exact attention) equals float64
    attention on the bf16-rounded inputs up to bf16 output rounding."""
    import oracle

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 40, h, 64)).astype(np.float32) for h in (4, 2, 2))
    spec = AttentionSpec.named("bf16")
    got = np.asarray(spec.prefill_fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sm_scale=0.125), np.float64)
    r = [np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v)]
    want = oracle.dma_attention(*r, causal=True, diag=None, sm_scale=0.125)
    assert oracle.rel_l2(got, want) < 1e-2
    # The output keeps the model's dtype.
    assert spec.prefill_fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sm_scale=0.125).dtype == jnp.float32


def test_cudnn_attention_says_it_needs_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU cuDNN runs: tests/test_gpu.py checks it")
    q = jnp.zeros((1, 4, 2, 64))
    with pytest.raises(ValueError, match="cudnn attention needs an NVIDIA GPU; JAX's default backend is 'cpu'"):
        AttentionSpec.named("cudnn").prefill_fn(q, q, q, sm_scale=0.125)


def test_cli_help_and_one_line_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m models.generate")
    assert "(default: dma)" in out and "(default: 64)" in out and "(default: 8)" in out
    for argv, message in ((["--diag-tiles", "-1"], "diag_tiles must be"),
                          (["--top-p", "0"], r"top_p must be in (0, 1]; got 0.0"),
                          (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1; got 0"),
                          (["--chunk", "0"], "--chunk must be >= 1; got 0"),
                          (["--kv-cache", "fp8"], "kv_cache='fp8' is the format of DMA decode's cache: it needs "
                                                  "decode='dma'"),
                          (["--decode-high", "bf16"], "decode_high='bf16' is a format of DMA decode's cache"),
                          (["--high", "bf16"], "argument --high: invalid choice: 'bf16'"),
                          (["--checkpoint", str(tmp_path / "nope.bin")], "neither a directory nor a .gguf file")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("decode_high", [[], ["--decode-high", "bf16"]], ids=["mxfp8-band", "bf16-band"])
def test_cli_decodes_with_dma_over_the_low_bit_cache(capsys, decode_high):
    """The README's DMA-decode command answers the prompt with the cache in DMA's
    formats (FP8 values too), its sink and band keys in MXFP8 or in bf16."""
    main(["--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "10", "--attention", "exact",
          "--decode-attention", "dma", "--kv-cache", "fp8", *decode_high])
    out = capsys.readouterr().out
    assert "Paris" in out and "attention exact/dma" in out


@pytest.mark.slow
def test_cli_answers_a_batch(capsys):
    """The README's --batch command: both prompts answered in one batch, one summary."""
    main(["--chat", "--batch", "--prompt", "What is the capital of France?", "--prompt", "Who wrote Hamlet?",
          "--max-new-tokens", "12", "--attention", "exact"])
    out = capsys.readouterr().out
    assert "> What is the capital of France?" in out and "> Who wrote Hamlet?" in out
    assert "Paris" in out and "Shakespeare" in out
    assert out.count("new tokens;") == 1 and "[2 prompts, " in out
