"""Plants for today's model families (issue 29): each breaks one property; the listed default-lane tests must fail."""
TODAY = "tests/test_conversion_today.py"
CLI = f"{TODAY}::test_each_family_converts_verifies_and_comes_back_bit_for_bit"

PLANTS = [
    dict(name="rope-scaling-factor-wrong", file="megatron_patch/models/gpt.py",
         original="        llama3_rope_scaling(model.rotary_pos_emb, base=cfg.rotary_base, factor=cfg.rope_scaling_factor,",
         replacement="        llama3_rope_scaling(model.rotary_pos_emb, base=cfg.rotary_base, factor=2 * cfg.rope_scaling_factor,",
         property="the engine scales RoPE by the model's own Llama 3.x factor (here: twice it)",
         tests=[f"{CLI}[llama3]"]),
    dict(name="rope-bounds-megatron-defaults", file="megatron_patch/models/gpt.py",
         original="    if cfg.use_rope_scaling:\n",
         replacement="    if False:  # megatron-core's hard-coded low/high frequency factors and original context\n",
         property="a Llama 3.x model's low/high frequency factors and original context are honoured, not megatron-core's "
                  "hard-coded 1, 4 and 8192",
         tests=[f"{CLI}[llama3]"]),
    dict(name="rope-bounds-swapped-on-import", file="megatron_patch/conversion/tables/llama.py",
         original='LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",\n'
                  '               "high_freq_factor": "rope_scaling_high_freq_factor",',
         replacement='LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_high_freq_factor",\n'
                     '               "high_freq_factor": "rope_scaling_low_freq_factor",',
         property="each of config.json's llama3 RoPE parameters reaches its own engine field",
         tests=[f"{TODAY}::test_llama3_scaling_reaches_the_engine_with_its_own_values", f"{CLI}[llama3]"]),
    dict(name="rope-scaling-type-ignored", file="megatron_patch/conversion/tables/llama.py",
         original='    args = dict(rotary_base=float(p["rope_theta"]), use_rope_scaling=kind == "llama3")',
         replacement='    args = dict(rotary_base=float(p["rope_theta"]), use_rope_scaling=False)',
         property="a Llama 3.1-3.3 config.json's RoPE scaling is applied, not silently dropped",
         tests=[f"{TODAY}::test_llama3_scaling_reaches_the_engine_with_its_own_values", f"{CLI}[llama3]"]),
    dict(name="qk-norms-swapped", file="megatron_patch/conversion/tables/llama.py",
         original='    Rule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), when=QK_NORM),\n'
                  '    Rule(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), when=QK_NORM),',
         replacement='    Rule(L + "self_attention.q_layernorm.weight", (H + "self_attn.k_norm.weight",), when=QK_NORM),\n'
                     '    Rule(L + "self_attention.k_layernorm.weight", (H + "self_attn.q_norm.weight",), when=QK_NORM),',
         property="Qwen3's query norm converts to the query norm and its key norm to the key norm",
         tests=[f"{CLI}[qwen3_moe]"]),  # (qwen3's own conversion, the same q/k norm rules, is slow)
    dict(name="qk-norm-off", file="megatron_patch/models/gpt.py",
         original="        qk_layernorm=cfg.qk_layernorm,\n",
         replacement="        qk_layernorm=False,\n",
         property="the engine builds Qwen3's per-head query/key norms (--qk-layernorm)",
         tests=[f"{CLI}[qwen3_moe]",
                "tests/test_families_engine.py::test_qwen3_at_tp2_with_sequence_parallelism_trains_like_one_process"]),
    dict(name="qwen3-moe-norm-topk-ignored", file="megatron_patch/conversion/tables/qwen2_moe.py",
         original='                moe_router_pre_softmax=not c.get("norm_topk_prob", False),',
         replacement='                moe_router_pre_softmax=True,',
         property="Qwen3-MoE's norm_topk_prob (renormalised top-k weights) is read from config.json",
         tests=[f"{CLI}[qwen3_moe]"]),
    dict(name="qwen3-presets-untied", file="megatron_patch/config/presets.py",
         original='    "qwen3": {"tiny": dict(kv_channels=48), **{s: dict(untie_embeddings_and_output_weights=False)',
         replacement='    "qwen3": {"tiny": dict(kv_channels=48), **{s: dict(untie_embeddings_and_output_weights=True)',
         property="the Qwen3 presets are the released shapes (the small sizes tie their embeddings)",
         tests=[f"{TODAY}::test_a_real_config_json_is_accepted_and_is_its_preset"]),
    dict(name="qwen2-shared-expert-dropped", file="megatron_patch/conversion/tables/qwen2_moe.py",
         original="        args.update(add_qkv_bias=bool(c.get(\"qkv_bias\", True)), moe_shared_expert_intermediate_size=shared,",
         replacement="        args.update(add_qkv_bias=bool(c.get(\"qkv_bias\", True)), moe_shared_expert_intermediate_size=None,",
         property="a Qwen2-MoE's shared expert is converted, not dropped",
         tests=["tests/test_conversion_moe.py::test_expert_rules_compute_transformers_experts[qwen2_moe]",
                "tests/test_conversion_moe.py::test_tables_use_every_tensor_save_pretrained_writes[qwen2_moe]"]),
]
PLANTS += [
    dict(name="qk-norm-grads-averaged-over-tp", file="megatron_patch/models/norm.py",
         original="    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):\n"
                  "        return torch_norm(config, hidden_size, eps)\n",
         replacement="    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):\n"
                     "        norm = torch_norm(config, hidden_size, eps)\n"
                     "        norm.weight.average_gradients_across_tp_domain = True\n"
                     "        return norm\n",
         property="the per-head q/k norms' gradients are summed over the TP group (each rank's heads contribute), not "
                  "averaged",
         tests=["tests/test_families_engine.py::test_qwen3_at_tp2_with_sequence_parallelism_trains_like_one_process"]),
    dict(name="tokenizer-style-digits", file="megatron_patch/data/train_tokenizer.py",
         original='    "llama3": dict(pattern=_LETTERS + r"\\p{N}{1,3}" + _REST,',
         replacement='    "llama3": dict(pattern=_LETTERS + r"\\p{N}" + _REST,',
         property="the Llama 3-style tokenizer splits digits in groups of up to three, as Llama 3's tokenizer.json",
         tests=["tests/test_tokenizers.py::test_model_directory_tokenizer_gives_transformers_ids_and_its_end_of_text"]),
]
MLA_TP = "tests/test_families_engine.py::test_multi_latent_attention_at_tp2_trains_like_one_process"
PLANTS += [
    dict(name="mla-kv-split-off-by-one", file="megatron_patch/conversion/tables/deepseek_v2.py",
         original='                kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_nope_head_dim"],\n'
                  '                qk_pos_emb_head_dim=c["qk_rope_head_dim"],',
         replacement='                kv_lora_rank=c["kv_lora_rank"] + 1, qk_head_dim=c["qk_nope_head_dim"],\n'
                     '                qk_pos_emb_head_dim=c["qk_rope_head_dim"] - 1,',
         property="MLA's key/value down projection is split into the latent and the RoPE key where DeepSeek splits it",
         tests=[f"{CLI}[deepseek_v2]", f"{TODAY}::test_a_real_config_json_is_accepted_and_is_its_preset"]),
    dict(name="deepseek-shared-experts-dropped", file="megatron_patch/conversion/tables/deepseek_v2.py",
         original="                moe_shared_expert_intermediate_size=shared * moe_ffn if shared else None,",
         replacement="                moe_shared_expert_intermediate_size=None,",
         property="DeepSeek-V2's shared experts are converted, not dropped",
         tests=[f"{CLI}[deepseek_v2]",
                "tests/test_conversion_moe.py::test_tables_use_every_tensor_save_pretrained_writes[deepseek_v2]"]),
    dict(name="deepseek-routed-scaling-ignored", file="megatron_patch/conversion/tables/deepseek_v2.py",
         original='                moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),',
         replacement='                moe_router_topk_scaling_factor=1.0,',
         property="DeepSeek's routed_scaling_factor scales the routed experts' weights in the engine",
         tests=[f"{CLI}[deepseek_v2]"]),
    dict(name="yarn-mscale-ignored", file="megatron_patch/conversion/tables/deepseek_v2.py",
         original='beta_slow=float(v["beta_slow"]), mscale=float(v["mscale"]), mscale_all_dim=float(v["mscale_all_dim"]),',
         replacement='beta_slow=float(v["beta_slow"]), mscale=1.0, mscale_all_dim=0.0,',
         property="YaRN's mscale and mscale_all_dim (the rotated channels' and the softmax's scaling) reach the engine",
         tests=[f"{CLI}[deepseek_v2]"]),
    dict(name="latent-norm-summed-over-tp", file="megatron_patch/models/norm.py",
         original="            p.average_gradients_across_tp_domain = not config.sequence_parallel",
         replacement="            p.average_gradients_across_tp_domain = False",
         property="MLA's query latent norm is not summed over TP ranks that all hold its whole gradient",
         tests=[f"{MLA_TP}[mla_dense_tp2]"]),
    dict(name="mla-rotary-key-grad-kept-per-rank", file="megatron_patch/models/gpt.py",
         original="        mla_rotary_key_gradient_over_tp()\n",
         replacement="        pass  # megatron-core's gather keeps one rank's part of the RoPE key's gradient\n",
         property="the shared RoPE key's gradient collects every TP rank's heads (compat.mla)",
         tests=[f"{MLA_TP}[mla_dense_tp2]", f"{MLA_TP}[deepseek_v2_tp2_sp]"]),
]
