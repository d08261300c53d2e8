"""Every flag of Megatron-LM's parser (``megatron.training.arguments``, core_v0.16.1 .. core_v0.19.x, and main as of
commit d98e8a6), as the MLLM's Megatron-LM launch (``pretrain_mllm.py --orch-trainer megatron-lm``) treats it.

Megatron-LM builds its own models from its flags (``core_transformer_config_from_args``); the MLLM is built
from ``--model-config`` and the few Megatron flags its providers read. So a flag that acts inside Megatron's
model would be silently ignored here. Each flag is in exactly one class (a test keeps the installed
release's parser covered: a flag of a new release that is in none fails it):

* :data:`READ_BY_MODEL`: the MLLM reads it (its providers, the backbone overrides of ``--model-config``,
  the data): parallel sizes, the backbone's shape, dropout, precision, initialisation, kernel fusions,
  ``--transformer-impl``, the sequence length and batch sizes, ``--data-path``, and an MoE backbone's
  experts, expert parallelism, load-balancing losses, token dispatcher and capacity (``--moe-layer-freq`` and
  ``--moe-shared-expert-intermediate-size`` checked against ``--model-config``);
* :data:`READ_BY_TRAINER`: ``megatron.training`` acts on it in its own loop, for the MLLM as for any model:
  the optimizer and its schedule, Megatron DDP and the distributed optimizer, checkpoints, the process
  groups, the iteration count, logging of the loop;
* :data:`NO_MATH`: it cannot change what a training step computes: logging, profiling, paths, timeouts,
  fault tolerance, communication tuning, and flags of other Megatron-LM entry points (inference, RL,
  retrieval, vision classification, distillation) that ``pretrain()`` with these providers never reads;
* :data:`REFUSED`: it changes the model or what it trains on and the MLLM does not implement it: refused
  by name when it differs from Megatron-LM's default (:func:`refusals`), before anything is initialised.

The compact trainer's parser (``--orch-trainer compact``) takes a subset of these flags; it explains one it does
not know with :func:`compact_trainer_reason`.

Post-balancing refuses a few more settings that upstream Megatron-LM runs with
(:data:`megatron_orch.megatron.megatron_lm.POST_BALANCING_REFUSALS`).
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from megatron_orch.trainer.arguments import megatron_dests


def _names(text: str) -> frozenset:
    return frozenset(text.split())


READ_BY_MODEL = _names("""
    tensor_model_parallel_size pipeline_model_parallel_size sequence_parallel context_parallel_size
    num_layers_per_virtual_pipeline_stage num_virtual_stages_per_pipeline_rank microbatch_group_size_per_vp_stage
    overlap_p2p_comm
    num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention num_query_groups kv_channels
    max_position_embeddings untie_embeddings_and_output_weights vocab_size make_vocab_size_divisible_by
    hidden_dropout attention_dropout bf16 init_method_std use_cpu_initialization transformer_impl
    calculate_per_token_loss bias_gelu_fusion bias_swiglu_fusion bias_dropout_fusion masked_softmax_fusion
    gradient_accumulation_fusion cross_entropy_loss_fusion
    seq_length micro_batch_size data_path distributed_backend
    num_experts moe_router_topk moe_ffn_hidden_size moe_shared_expert_intermediate_size moe_layer_freq
    expert_model_parallel_size moe_router_load_balancing_type moe_aux_loss_coeff moe_z_loss_coeff
    moe_token_dispatcher_type moe_expert_capacity_factor
""")

READ_BY_TRAINER = _names("""
    global_batch_size train_iters train_samples exit_interval exit_duration_in_mins exit_signal_handler exit_signal
    exit_signal_handler_for_dataloader exit_signal_handler_for_training seed dataloader_type
    optimizer lr min_lr lr_decay_style lr_wsd_decay_style lr_decay_iters lr_decay_samples lr_wsd_decay_iters
    lr_wsd_decay_samples lr_warmup_fraction lr_warmup_iters lr_warmup_samples lr_warmup_init
    override_opt_param_scheduler use_checkpoint_opt_param_scheduler start_weight_decay end_weight_decay
    weight_decay_incr_style weight_decay clip_grad adam_beta1 adam_beta2 adam_eps sgd_momentum
    decoupled_lr decoupled_min_lr no_weight_decay_cond_type apply_wd_to_qk_layernorm
    muon_momentum muon_split_qkv muon_nesterov muon_use_nesterov muon_scale_mode muon_fp32_matmul_prec
    muon_coefficient_type muon_num_ns_steps muon_tp_mode muon_extra_scale_factor muon_scalar_optimizer
    muon_use_syrk
    lion_beta1 lion_beta2
    optimizer_cpu_offload optimizer_offload_fraction use_torch_optimizer_for_cpu_offload
    overlap_cpu_optimizer_d2h_h2d pin_cpu_grads pin_cpu_params optimizer_cuda_graph
    use_precision_aware_optimizer main_grads_dtype main_params_dtype exp_avg_dtype exp_avg_sq_dtype
    loss_scale initial_loss_scale min_loss_scale loss_scale_window hysteresis grad_reduce_in_bf16
    accumulate_allreduce_grads_in_fp32
    use_distributed_optimizer overlap_grad_reduce overlap_param_gather overlap_param_gather_with_optimizer_step
    align_grad_reduce align_param_gather ddp_num_buckets ddp_bucket_size ddp_pad_buckets_for_high_nccl_busbw
    ddp_reduce_scatter_with_fp32_accumulation ddp_param_name_patterns_for_fp32_local_accumulation
    ddp_average_in_collective num_distributed_optimizer_instances use_layer_wise_param_layout
    gradient_reduce_div_fusion check_for_nan_in_loss_and_grad check_for_large_grads
    rampup_batch_size step_batch_size_schedule decrease_batch_size_if_needed
    use_megatron_fsdp use_torch_fsdp2 data_parallel_sharding_strategy outer_dp_sharding_strategy
    megatron_fsdp_version
    fsdp_double_buffer suggested_communication_unit_size keep_fp8_transpose_cache enable_full_sharding_in_hsdp
    torch_fsdp2_reshard_after_forward megatron_fsdp_main_params_dtype megatron_fsdp_main_grads_dtype
    megatron_fsdp_grad_comm_dtype megatron_fsdp_enable_fine_grained_param_gather
    megatron_fsdp_max_pool_double_buffer fsdp_db_use_persist_buf_on_alloc_fail strict_fsdp_dtensor_load
    save save_interval save_retain_interval load load_main_params_from_ckpt non_persistent_save_interval
    non_persistent_ckpt_type non_persistent_global_ckpt_dir non_persistent_local_ckpt_dir
    non_persistent_local_ckpt_algo finetune pretrained_checkpoint ckpt_step use_mp_args_from_checkpoint_args
    exit_on_missing_checkpoint ckpt_format auto_detect_ckpt_format ckpt_convert_format ckpt_convert_save
    ckpt_convert_update_legacy_dist_opt_format ckpt_fully_parallel_save async_save async_strategy
    use_persistent_ckpt_worker async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm
    ckpt_fully_parallel_load ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_save_process_group
    ckpt_fully_parallel_load_process_group ckpt_assume_constant_structure ckpt_load_validate_sharding_integrity
    ckpt_fully_parallel_load_per_rank_objects ckpt_pg_tensors_cache_path ckpt_pg_tensors_cache_create
    ckpt_drop_redundant_extra_state save_tokenizer_assets
    dist_ckpt_strictness dist_ckpt_save_pre_mcore_014 dist_ckpt_optim_fully_reshardable
    distrib_optim_fully_reshardable_mem_efficient replication replication_jump replication_factor
    verify_integrity stream_ckpt_dequant no_save_optim no_save_rng no_load_optim no_load_rng
    override_ckpt_iteration use_dist_ckpt_deprecated dist_ckpt_format_deprecated dist_ckpt_workers
    ckpt_fully_parallel_save_deprecated
    distributed_timeout_minutes local_rank lazy_mpu_init use_tp_pp_dp_mapping enable_gloo_process_groups
    use_gloo_process_groups fake_process_group model_parallel_size
    eval_iters eval_interval start_eval_at_iter eval_global_batch_size eval_micro_batch_size skip_train
    full_validation multiple_validation_sets validation_set_names
    rerun_mode error_injection_rate error_injection_type check_for_spiky_loss
    freeze_all_layers data_parallel_random_init batch_invariant_mode
    batch_invariant_backend
""")

NO_MATH = _names("""
    log_interval log_params_norm log_throughput log_progress timing_log_level timing_log_option tensorboard_dir
    tensorboard_log_interval tensorboard_queue_size log_timers_to_tensorboard log_loss_scale_to_tensorboard
    log_validation_ppl_to_tensorboard log_memory_to_tensorboard log_memory_interval log_device_memory_used
    log_num_zeros_in_grad log_max_attention_logit barrier_with_L1_time log_world_size_to_tensorboard
    wandb_project wandb_exp_name wandb_save_dir wandb_entity logging_level log_energy config_logger_dir
    moe_routing_trace_path moe_routing_trace_max_training_iters moe_routing_trace_capture_logits
    moe_routing_trace_capture_hidden_states moe_routing_trace_dump_weights moe_per_layer_logging
    profile profile_step_start profile_step_end use_pytorch_profiler pytorch_profiler_collect_shapes
    pytorch_profiler_collect_callstack pytorch_profiler_collect_chakra profile_ranks record_memory_history
    memory_snapshot_path record_shapes nvtx_ranges
    log_straggler straggler_ctrlr_port straggler_minmax_count disable_straggler_on_startup
    run_workload_inspector_server
    enable_one_logger one_logger_project one_logger_run_name one_logger_async app_tag_run_name app_tag_run_version
    otel_enabled otel_service_name otel_span_groups gtp_remat_nccl_ub gtp_expert_remat_nccl_ub
    inprocess_restart inprocess_max_iterations inprocess_monitor_thread_interval inprocess_monitor_process_interval
    inprocess_progress_watchdog_interval inprocess_heartbeat_interval inprocess_soft_timeout inprocess_hard_timeout
    inprocess_heartbeat_timeout inprocess_barrier_timeout inprocess_completion_timeout inprocess_last_call_wait
    inprocess_termination_grace_time inprocess_granularity inprocess_active_world_size inprocess_empty_cuda_cache
    enable_ft_package calc_ft_timeouts ft_num_warmup_iters adlr_autoresume adlr_autoresume_interval
    fault_injector_ranks fault_injector_num_ranks fault_injector_fault_types fault_injector_fault_probabilities
    fault_injector_fault_delay fault_injector_delay_start_iteration fault_injector_mtti_seconds
    fault_injector_offset_seconds fault_injector_seed
    flight_recorder_dump_path flight_recorder_trace_buffer_size flight_recorder_dump_on_timeout
    flight_recorder_include_stack_trace flight_recorder_include_only_active flight_recorder_extra_dump_on_exec
    distributed_timeout_seconds_after_init nccl_communicator_config_path use_sharp sharp_enabled_group
    high_priority_stream_groups nccl_ub disable_symmetric_registration fsdp_manual_registration
    create_all_gather_group tp_comm_bootstrap_backend pipeline_model_parallel_comm_backend
    use_ring_exchange_p2p overlap_p2p_comm_warmup_flush scatter_gather_tensors_in_pipeline
    enable_msc disable_msc_deprecated empty_unused_memory_level manual_gc manual_gc_interval manual_gc_eval
    train_sync_interval check_weight_hash_across_dp_replicas_interval gpu_sniff_test_interval
    result_rejected_tracker_filename save_params_interval save_activations_interval save_tokens_per_expert_interval
    save_wgrads_interval save_dgrads_interval dump_param_to_param_group_map test_mode deterministic_mode
    disable_jit_fuser deprecated_use_mcore_models async_tensor_model_parallel_allreduce moe_extended_tp
    num_workers data_cache_path mmap_bin_files dataloader_fast_cache_load dataloader_defer_npy_index_mmap
    num_dataset_builder_threads object_storage_cache_path mid_level_dataset_surplus per_dataset_sequences_path
    tokenizer_type tokenizer_model vocab_file merge_file vocab_extra_ids metadata_path special_tokens
    tiktoken_pattern tiktoken_num_special_tokens tokenizer_sentencepiece_legacy
    tokenizer_sentencepiece_ignore_extra_whitespaces tokenizer_hf_no_use_fast tokenizer_hf_no_include_special_tokens
    trust_remote_code null_tokenizer_eod_id null_tokenizer_pad_id chat_template tokenizer_metadata
    tokenizer_special_tokens legacy_tokenizer tiktoken_special_tokens tokenizer_hf_use_fast
    tokenizer_hf_include_special_tokens use_tokenizer_model_from_checkpoint_args
    use_gigatoken
    inference_batch_times_seqlen_threshold max_tokens_to_oom output_bert_embeddings bert_embedder_type
    use_legacy_static_engine inference_max_requests inference_max_batch_size inference_max_seq_length
    inference_dynamic_batching inference_dynamic_batching_buffer_size_gb
    inference_dynamic_batching_paused_buffer_size_gb
    inference_dynamic_batching_mamba_memory_ratio inference_dynamic_batching_block_size
    inference_dynamic_batching_max_requests inference_dynamic_batching_max_tokens
    inference_dynamic_batching_num_cuda_graphs inference_dynamic_batching_track_paused_request_events
    inference_dynamic_batching_track_generated_token_events decode_only_cuda_graphs inference_cuda_graph_all_prefills
    inference_cuda_graph_max_tokens inference_dynamic_batching_unified_memory_level enable_chunked_prefill
    disable_chunked_prefill num_speculative_tokens inference_dynamic_batching_enable_prefix_caching
    inference_dynamic_batching_prefix_caching_eviction_policy
    inference_dynamic_batching_prefix_caching_coordinator_policy
    inference_dynamic_batching_prefix_caching_routing_alpha inference_dynamic_batching_prefix_caching_mamba_gb
    inference_dynamic_batching_cuda_graph_mixed_prefill_count inference_dynamic_batching_cuda_graph_sizing_distribution
    inference_dynamic_batching_cuda_graph_max_tokens inference_dynamic_batching_sampling_backend
    offset_sampling_seed_by_dp_rank inference_dynamic_batching_async_sched_mode inference_dynamic_batching_logprobs_mode
    inference_logging_step_interval inference_text_gen_server_logging inference_wandb_logging
    inference_coordinator_port mamba_inference_conv_states_dtype mamba_inference_ssm_states_dtype
    inference_use_synchronous_zmq_collectives inference_disable_ep_consensus inference_shards inference_rng_tracker
    inference_cuda_graph_scope flash_decode nccl_all_reduce_for_prefill inference_fuse_tp_communication
    inference_disable_triton_nvls_kernels inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels
    inference_moe_token_dispatcher_type mlp_chunks_for_prefill symmetric_ar_type cache_mla_latents
    moe_pad_experts_for_cuda_graph_inference
    rl_prompts_per_eval grpo_prompts_per_step grpo_group_size rl_generation_lag rl_submission_granularity
    rl_consumption_granularity grpo_iterations grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_kl_beta
    grpo_entropy_term_weight grpo_filter_groups_with_same_reward langrl_env_config rl_default_temperature
    rl_default_top_p rl_default_top_k rl_offload_optimizer_during_inference rl_kv_cache_management_mode
    rl_persist_cuda_graphs rl_partial_rollouts rl_inference_logprobs_is_correction
    rl_importance_sampling_truncation_coef rl_use_sequence_packing rl_sequence_packing_max_sequences_per_bin
    rl_sequence_packing_algo rl_training_cuda_graphs rl_inference_tensor_model_parallel_size
    rl_inference_pipeline_model_parallel_size rl_inference_expert_model_parallel_size
    rl_inference_expert_tensor_model_parallel_size rl_inference_model_unified_memory_level
    rl_offload_inference_model_weights_when_idle refit_method rl_verify_model_weights_swap rl_skip_bos_token
    rl_profile rl_profile_dir rl_inference_parsers langrl_inference_server_type
    langrl_inference_server_conversation_template langrl_external_server rl_offload_kv_cache_during_training
    rl_remove_kv_cache_during_training rl_reset_cuda_graphs rl_parallel_generation_tasks
    rl_max_inflight_requests rl_durable_rollout_bank rl_rollout_bank_dir rl_rollout_bank_max_bytes
    ict_head_size biencoder_projection_dim biencoder_shared_query_context_model ict_load bert_load titles_data_path
    query_in_block_prob use_one_sent_docs evidence_data_path retriever_report_topk_accuracies retriever_score_scaling
    block_data_path embedding_path indexer_batch_size indexer_log_interval bert_binary_head
    num_classes img_h img_w num_channels patch_dim classes_fraction data_per_class_fraction data_sharding
    head_lr_mult vision_pretraining vision_pretraining_type vision_backbone_type swin_backbone_type mask_type
    mask_factor iter_per_epoch dino_local_img_size dino_local_crops_number dino_head_hidden_size
    dino_bottleneck_size dino_freeze_last_layer dino_norm_last_layer dino_warmup_teacher_temp dino_teacher_temp
    dino_warmup_teacher_temp_epochs mask_prob short_seq_prob
    logits_save_top_k logits_save_top_p logits_save_top_p_min_k logits_save_dir logits_save_dtype
    sft sft_tokenizer_prompt_format
    apply_rope_fusion clone_scatter_output_in_embedding
""")

# Reasons, one per kind of refused flag.
_ARCHITECTURE = ("the MLLM's architecture comes from --model-config (configs/*.yaml: encoders, a GPT backbone with "
                 "LayerNorm, GeLU or a gated FFN by its shape, learned absolute positions); this flag would be ignored")
_MOE = ("the MLLM's MoE backbone (--num-experts, or a --model-config with num_experts) reads its experts, "
        "--moe-router-topk, --moe-ffn-hidden-size, --expert-model-parallel-size, the load-balancing loss, the "
        "token dispatcher and the capacity factor only; this flag would be ignored")
_PRECISION = "the MLLM trains in fp32 or bf16 (--bf16) with megatron-core's own layers; this flag would be ignored"
_MODEL_OPTION = ("Megatron-LM passes it to the layers of the models it builds; the MLLM builds its layers from "
                 "--model-config and does not implement it, so it would be ignored")
_DATA = ("the MLLM's data comes from its own loader (--data-path, one JSONL manifest, or synthetic examples); "
         "Megatron-LM's datasets are not built, so this flag would be ignored")
_PARALLEL = "this layout is not implemented by the MLLM's model build; the flag would be ignored"
_LAUNCH = "it replaces the command line's settings with others the MLLM's providers do not read"
_OTHER_LOOP = ("it trains another way than the MLLM's pretraining (RL rollouts, distillation from saved logits, "
               "Megatron-LM's legacy or custom-spec models)")
_PACKING_SCHEDULER = (
    "Megatron-LM's sequence-packing scheduler re-packs each step's samples in train_step, and its dp_balanced one "
    "moves them across DP ranks: it takes GPT samples (tokens, labels, loss_mask, position_ids and their lengths), "
    "which the MLLM's micro-batches (with their encoder items) are not, and with --orch-post-balancing two balancers "
    "would move the same examples; --orch-post-balancing --orch-microbatching packed packs and balances them")
_SAMPLES = ("Megatron-LM's old batch size and warmup flags, which its loop no longer reads: use --micro-batch-size, "
            "--global-batch-size and --lr-warmup-iters or --lr-warmup-samples")

REFUSED: Dict[str, str] = {
    **dict.fromkeys(_names("""
        position_embedding_type use_rotary_position_embeddings add_position_embedding rotary_base rotary_percent
        rotary_interleaved rotary_seq_len_interpolation_factor use_rope_scaling rope_scaling_factor rope_type
        no_rope_freq mrope_section yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow
        yarn_correction_range_round_to_int relative_attention_num_buckets relative_attention_max_distance
        normalization layernorm_epsilon layernorm_zero_centered_gamma qk_layernorm qk_l2_norm
        qk_clip qk_clip_alpha qk_clip_threshold swiglu squared_relu quick_geglu openai_gelu onnx_safe
        add_bias_linear add_qkv_bias glu_linear_offset activation_func_clamp_value attention_output_gate
        apply_residual_connection_post_layernorm fp32_residual_connection apply_query_key_layer_scaling
        attention_softmax_in_fp32 softmax_type window_size window_attn_skip_freq embedding_init_method_std
        init_method_xavier_uniform perform_initialization init_model_with_meta_device
        use_mup mup_width_mult mup_base_hidden_size mup_embedding_mult mup_output_mult mup_base_head_dim
        mup_attn_scale_power multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim
        v_head_dim rotary_scaling_factor mscale mscale_all_dim mla_down_proj_fusion
        experimental_attention_variant linear_attention_freq dsa_indexer_n_heads dsa_indexer_head_dim
        dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_skip_topk_offset dsa_indexer_loss_coeff
        dsa_indexer_use_sparse_loss dsa_kernel_backend dsa_indexer_rope_interleaved dsa_indexer_rotate_activation
        dsa_indexer_scoring_relu dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 linear_conv_kernel_dim
        linear_key_head_dim linear_value_head_dim linear_num_key_heads linear_num_value_heads
        is_hybrid_model hybrid_layer_pattern hybrid_override_pattern hybrid_attention_ratio hybrid_mlp_ratio
        mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads use_mamba_mem_eff_path
        mamba_training_ssm_states_dtype mtp_num_layers mtp_loss_scaling_factor mtp_use_repeated_layer
        mtp_detach_heads mtp_hybrid_override_pattern mtp_standalone encoder_num_layers decoder_num_layers
        encoder_seq_length decoder_seq_length padded_vocab_size pad_vocab_size heterogeneous_layers_config_path
        heterogeneous_layers_config_encoded_json
        enable_mhc_connections mhc_num_residual_streams mhc_sinkhorn_iterations mhc_init_gating_factor
        mhc_recompute_layer_num gdp_num_householder gdp_cutedsl_kernel gdp_num_chunk_states_to_recompute mtp_hsm
    """), _ARCHITECTURE),
    **dict.fromkeys(_names("""
        moe_shared_expert_gate
        moe_shared_expert_overlap use_grouped_gemm_for_shared_expert moe_shared_expert_glu_interleave_size
        moe_enable_routing_replay moe_router_padding_for_quantization moe_router_padding_for_fp8
        moe_router_num_groups moe_router_group_topk moe_router_pre_softmax moe_router_topk_scaling_factor
        moe_router_score_function moe_router_dtype moe_router_enable_expert_bias moe_router_bias_update_rate
        moe_router_quantile_balancing_ema moe_router_force_load_balancing moe_router_force_biased
        moe_input_jitter_eps moe_grouped_gemm
        moe_single_grouped_weight moe_single_grouped_bias moe_use_legacy_grouped_gemm
        moe_enable_deepep moe_flex_dispatcher_backend moe_permute_fusion_into_hybridep
        moe_hybridep_pad_uneven_dispatch_inputs moe_pad_expert_input_to_capacity
        moe_token_drop_policy moe_layer_recompute moe_permute_fusion moe_router_fusion moe_apply_probs_on_input
        moe_latent_size moe_flex_dispatcher_num_sms moe_deepep_num_sms moe_hybridep_num_sms
        moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing
        moe_ncclep_static_shape moe_ncclep_zero_copy moe_mlp_glu_interleave_size moe_expert_rank_capacity_factor
        moe_use_upcycling moe_upcycling_granularity moe_paged_stash moe_paged_stash_page_size
        moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu use_fused_weighted_squared_relu
        moe_use_grouped_tensor moe_dispatch_fwd_dtype moe_combine_bwd_dtype
        overlap_moe_expert_parallel_comm overlap_dispatch_backward_with_experts_wgrad
        ep_overlap_early_attn_memory_release
        high_priority_a2a_comm_stream expert_tensor_parallel_size
        expert_tensor_parallel_num_weight_shards
    """), _MOE),
    **dict.fromkeys(_names("""
        fp16 fp8 fp8_recipe fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len fp8_amax_compute_algo
        fp8_wgrad fp8_output_proj fp8_param_gather first_last_layers_bf16 num_layers_at_start_in_bf16
        num_layers_at_end_in_bf16 fp4 fp4_recipe fp4_quantizer_factory fp4_param fp4_param_gather
        te_precision_config_file reuse_grad_buf_for_mxfp8_param_ag fp16_lm_cross_entropy
        disable_bf16_reduced_precision_matmul use_kitchen_attention kitchen_attention_backend
        logit_dtype
    """), _PRECISION),
    **dict.fromkeys(_names("""
        recompute_granularity recompute_method recompute_num_layers recompute_modules distribute_saved_activations
        recompute_activations checkpoint_activations cpu_offloading_num_layers cpu_offloading_retain_pinned_cpu_buffers
        fine_grained_activation_offloading offload_modules min_offloaded_tensor_size delay_offload_until_cuda_graph
        delta_offload_bytes_across_pp_ranks activation_offload_fraction fine_grained_offloading_max_inflight_offloads
        tp_comm_overlap tp_comm_overlap_cfg tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs
        tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs delay_wgrad_compute defer_embedding_wgrad_compute
        wgrad_deferral_limit enable_cuda_graph cuda_graph_warmup_steps external_cuda_graph cuda_graph_impl
        cuda_graph_scope cuda_graph_scope_deprecated cuda_graph_modules use_te_activation_func
        attention_backend flash_attention_version use_flash_attn cross_entropy_fusion_impl no_persist_layer_norm
        fused_residual_rmsnorm use_transformer_engine_op_fuser use_grouped_gemm_for_dense_mlp mlp_chunks_for_training
        cp_comm_type account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
    """), _MODEL_OPTION),
    **dict.fromkeys(_names("""
        hierarchical_context_parallel_sizes hybrid_context_parallel max_seqlen_per_dp_cp_rank
        tensor_parallel_num_weight_shards decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers
        pipeline_model_parallel_layout
        gtp_remat_opt_in_modules gtp_remat_reduce_scatter_with_fp32_accumulation
    """), _PARALLEL),
    **dict.fromkeys(_names("""
        split train_data_path valid_data_path test_data_path data_args_path per_split_data_args_path mock_data
        phase_transition_iterations sample_rate reset_position_ids reset_attention_mask
        dataloader_inter_document_masking
        eod_mask_loss create_attention_mask_in_dataloader allow_ambiguous_pad_tokens fim_data fim_rate fim_spm_rate
        fim_split_sample fim_fragment_rate fim_no_prefix fim_prefix_token fim_middle_token fim_suffix_token
        fim_pad_token fim_eod_token sft_mock_dataset_config_json varlen_mock_dataset_config_json
        varlen_sbhd_validation
    """), _DATA),
    **dict.fromkeys(_names("yaml_cfg use_checkpoint_args"), _LAUNCH),
    **dict.fromkeys(_names("""
        perform_rl_step logits_load_dir logits_load_decode_threads logits_load_prefetch_factor
        logits_load_msc_prefetch_depth logits_load_kd_loss_alpha logits_load_ignore_errors spec use_legacy_models
        enable_experimental te_rng_tracker
    """), _OTHER_LOOP),
    **dict.fromkeys(_names("batch_size warmup"), _SAMPLES),
    **dict.fromkeys(_names("sequence_packing_scheduler use_varlen_dataset"), _PACKING_SCHEDULER),
    "iterations_to_skip": "megatron.training runs a skipped iteration through Megatron-LM's GPT batch code "
                          "(get_batch_on_this_tp_rank), which the MLLM's batches are not",
}


# Megatron-LM's options (core_v0.16.1 .. core_v0.19.x and main) whose dest is not their name, nor their name without a
# leading no- or disable- (megatron_orch.trainer.arguments.megatron_dests): what the compact trainer's parser
# needs to name their class without Megatron-LM's parser (a test keeps it complete for the installed release).
OPTION_DESTS = {
    "--apply-layernorm-1p": "layernorm_zero_centered_gamma", "--bert-no-binary-head": "bert_binary_head",
    "--ckpt-fully-parallel-save": "ckpt_fully_parallel_save_deprecated",
    "--cuda-graph-scope": "cuda_graph_scope_deprecated", "--disable-bias-linear": "add_bias_linear",
    "--disable-gloo-process-groups": "use_gloo_process_groups",
    "--disable-mamba-mem-eff-path": "use_mamba_mem_eff_path", "--disable-msc": "disable_msc_deprecated",
    "--dist-ckpt-format": "dist_ckpt_format_deprecated", "--enable-chunked-prefill": "disable_chunked_prefill",
    "--fp4-format": "fp4", "--fp4-param-gather": "fp4_param", "--fp8-format": "fp8",
    "--inference-dynamic-batching-prefix-caching": "inference_dynamic_batching_enable_prefix_caching",
    "--inference-max-requests": "inference_max_batch_size",
    "--microbatch-group-size-per-virtual-pipeline-stage": "microbatch_group_size_per_vp_stage",
    "--muon-no-split-qkv": "muon_split_qkv", "--no-barrier-with-level-1-timing": "barrier_with_L1_time",
    "--no-inference-dynamic-batching-prefix-caching": "inference_dynamic_batching_enable_prefix_caching",
    "--no-initialization": "perform_initialization", "--no-one-logger": "enable_one_logger",
    "--no-overlap-p2p-communication": "overlap_p2p_comm", "--no-position-embedding": "add_position_embedding",
    "--output-logit-dtype": "logit_dtype",
    "--no-rope-fusion": "apply_rope_fusion", "--norm-epsilon": "layernorm_epsilon",
    "--overlap-p2p-communication-warmup-flush": "overlap_p2p_comm_warmup_flush",
    "--persistent-save-interval": "save_interval", "--tokenizer-metadata": "metadata_path",
    "--tokenizer-special-tokens": "special_tokens",
    "--torch-fsdp2-no-reshard-after-forward": "torch_fsdp2_reshard_after_forward",
    "--use-dist-ckpt": "use_dist_ckpt_deprecated", "--use-mcore-models": "deprecated_use_mcore_models",
    "--use-nccl-ub": "nccl_ub", "--use-same-sampling-seed-across-dp-ranks": "offset_sampling_seed_by_dp_rank",
}


def compact_trainer_reason(flag: str) -> Optional[str]:
    """Why the compact trainer refuses Megatron-LM's option ``flag`` (``--swiglu``) for the MLLM (its parser does
    not know it), or None where ``flag`` is no option of Megatron-LM's."""
    for dest in (OPTION_DESTS[flag],) if flag in OPTION_DESTS else megatron_dests(flag):
        if dest in REFUSED:
            return REFUSED[dest]
        if any(dest in names for names in (READ_BY_MODEL, READ_BY_TRAINER, NO_MATH)):
            return ("it is read by Megatron-LM's own loop: pretrain_mllm.py --orch-trainer megatron-lm (GPUs) takes "
                    "it; pretrain_mllm.py --help lists the compact trainer's flags")
    return None


def megatron_lm_parser(extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]):
    """Megatron-LM's parser of the installed release with ``extra_args_provider``'s flags, as Megatron-LM's
    ``parse_args`` builds it (without parsing ``sys.argv``)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    return extra_args_provider(add_megatron_arguments(parser))


def refusals(argv: Sequence[str], extra_args_provider: Callable) -> List[str]:
    """What the MLLM's Megatron-LM launch refuses of command line ``argv`` (:func:`refusals_of`). Parsing only:
    nothing is initialised. Flags this parser does not know are left to Megatron-LM's own parser."""
    parser = megatron_lm_parser(extra_args_provider)
    return refusals_of(parser.parse_known_args(list(argv))[0], parser)


def refusals_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> List[str]:
    """One entry per refused flag of parsed ``args``, each naming it: a :data:`REFUSED` flag away from the
    parser's default, a missing ``--calculate-per-token-loss``, and the backbone settings that disagree with
    ``--model-config`` (its vocabulary, its tied or untied embeddings)."""
    from megatron_orch.mllm.config import load_model_config

    defaults = parser.parse_known_args([])[0]
    problems, seen = [], set()
    for action in parser._actions:  # in the parser's order
        dest = action.dest
        if dest in REFUSED and dest not in seen and getattr(args, dest) != getattr(defaults, dest):
            seen.add(dest)
            problems.append(f"{_long_option(action)} ({getattr(args, dest)!r}): {REFUSED[dest]}")
    if args.context_parallel_size > 1 and args.transformer_impl == "local" and args.distributed_backend != "gloo":
        problems.append(f"--context-parallel-size {args.context_parallel_size} with --transformer-impl local: on GPUs "
                        "context parallelism runs Transformer Engine's attention (--transformer-impl "
                        "transformer_engine); the local attention's context-parallel path is the CPU one (gloo)")
    if not args.calculate_per_token_loss:
        problems.append("--calculate-per-token-loss is required: the MLLM normalises its loss by the number of loss "
                        "tokens (without the flag Megatron-LM would average per micro-batch)")
    try:
        model_config = load_model_config(args.model_config)
    except (OSError, ValueError, TypeError) as err:
        return problems + [f"--model-config {args.model_config}: {err}"]
    backbone = model_config.backbone
    if args.vocab_size is not None and args.vocab_size != backbone.transformer.vocab_size:
        problems.append(f"--vocab-size {args.vocab_size}: the backbone of --model-config {model_config.name} has "
                        f"vocab_size {backbone.transformer.vocab_size} (its data brings token ids of that vocabulary)")
    if args.untie_embeddings_and_output_weights and not backbone.untie_embeddings_and_output_weights:
        problems.append(f"--untie-embeddings-and-output-weights: the backbone of --model-config {model_config.name} "
                        "ties its embeddings and output weights (untie_embeddings_and_output_weights: false)")
    return problems


def _long_option(action: argparse.Action) -> str:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return next((o for o in longs if "_" not in o), longs[0] if longs else action.dest)


def classes() -> Mapping[str, frozenset]:
    """The classes by name (the audit test checks that they split the installed parser's flags)."""
    return {"read by the model": READ_BY_MODEL, "read by megatron.training": READ_BY_TRAINER,
            "cannot change the math": NO_MATH, "refused": frozenset(REFUSED)}
