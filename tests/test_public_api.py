"""The public API, what docs/own_model.md shows (the contract and batches, ``post_balance`` and the schedule,
the compact trainer's ``TrainingTask`` path: ``megatron_orch.megatron.__all__`` and
``megatron_orch.trainer.PUBLIC``), pinned: every signature's parameters (names, order, kind, whether
required) against a recorded table, so that no change breaks a caller silently. A changed signature keeps its
old call working for a release with a DeprecationWarning naming the new one (tested below for the trainer's
calls that took a task first, and the DDP classes its loop imported), and then its row here changes."""
import importlib
import inspect
import warnings

import pytest

SIGNATURES = {
    'megatron_orch.megatron.BackbonePhase': '(name, cost, token_bytes)',
    'megatron_orch.megatron.BalanceableModel': '(*args, **kwargs)',
    'megatron_orch.megatron.BalancedMicroBatch': '(batch, num_items, embeds=)',
    'megatron_orch.megatron.BalancedStep':
        '(microbatches, inputs, plan, rank, num_tokens, rows_per_item, comm_group, moves, '
        'timings=, home=, encoder_group=, encoder_rank=, pipeline_group=, check_again=, run_peers=)',
    'megatron_orch.megatron.BatchSpec': '(phases, inputs, pad_token_id, seq_length, cannot_pack=, takes_packed_rows=)',
    'megatron_orch.megatron.CostModel': '(*args, **kwargs)',
    'megatron_orch.megatron.CostProfile': '(source, device, dtype, model_name, shape, phases)',
    'megatron_orch.megatron.EncoderInput': '(phase, item_shape, placeholder_id)',
    'megatron_orch.megatron.EncoderPhase': '(name, cost, item_tokens, input_bytes, output_rows, output_row_bytes)',
    'megatron_orch.megatron.Example': '(sample_index, tokens, labels, loss_mask, items=)',
    'megatron_orch.megatron.ExampleSizes': '(sample_index, items, num_tokens, num_loss_tokens)',
    'megatron_orch.megatron.FunctionCost': '(cost, memory=, signature_fields=)',
    'megatron_orch.megatron.MegatronModelMixin': '()',
    'megatron_orch.megatron.MicroBatch':
        '(tokens, labels, loss_mask, position_ids, seq_lengths, items, item_counts, sample_ids, '
        'placeholders, cu_seqlens=, host_cu_seqlens=)',
    'megatron_orch.megatron.MimoBalancing':
        '(mimo, modalities, backbone_cost, embedding_bytes_per_element=, token_bytes=)',
    'megatron_orch.megatron.MimoModality':
        '(name, encoder, keyword, item_shape, rows_per_item, item_tokens, cost, bytes_per_element=)',
    'megatron_orch.megatron.ModalityAwareSchedule':
        '(forward_backward_func, dp_group, encoder_recompute=, announce=, encoders_on_every_stage=)',
    'megatron_orch.megatron.ModelPhases': '(encoders, backbone)',
    'megatron_orch.megatron.OrchestratorConfig':
        '(phases=, algorithm=, microbatching=, locality=, placement=, placement_time_limit_s=, '
        'gpus_per_node=, background=, encoder_recompute=, encoder_chunk_tokens=, '
        'encoder_memory_cap=, cost_profile=, context_parallel_size=, step_model=, shadow=, '
        'verify_first_step=, all_to_all=, encoder_ranks=, encoder_tensor_parallel_size=)',
    'megatron_orch.megatron.ParallelGroups':
        '(dp_group, topology, encoder_stage=, peer_group=, comm_group=, encoder_group=, pipeline_group=, '
        'tp_replicas=)',
    'megatron_orch.megatron.PostBalancingDataIterator':
        '(source, spec, config, step, groups, *, compute_device, input_dtype=)',
    'megatron_orch.megatron.ProfileCost': '(fit, base)',
    'megatron_orch.megatron.ProjectorShape': '(input_size, ffn_hidden_size, output_size)',
    'megatron_orch.megatron.ShadowStep': '(microbatches, plan, rank, num_tokens, timings=, run_peers=)',
    'megatron_orch.megatron.StepShape': '(micro_batch_size, num_microbatches, pad_to=, ramp_up=)',
    'megatron_orch.megatron.Topology': '(node_of_rank)',
    'megatron_orch.megatron.TransformerCost': '(transformer, projector=, projector_tokens=, details=)',
    'megatron_orch.megatron.TransformerShape':
        '(num_layers, hidden_size, ffn_hidden_size, num_attention_heads, causal, '
        'num_query_groups=, kv_channels=, gated_linear_unit=, vocab_size=, num_experts=, '
        'moe_router_topk=, moe_ffn_hidden_size=, moe_shared_expert_intermediate_size=)',
    'megatron_orch.megatron.add_orch_args': '(parser)',
    'megatron_orch.megatron.check_model': '(model)',
    'megatron_orch.megatron.collate': '(examples, spec, pad_to=, pad_to_multiple_of=)',
    'megatron_orch.megatron.collate_packed': '(examples, spec, pad_to=, pad_to_multiple_of=)',
    'megatron_orch.megatron.forward_step': '(data_iterator, model)',
    'megatron_orch.megatron.group_topology': '(group=, gpus_per_node=, env=)',
    'megatron_orch.megatron.load_cost_profile': '(path, phases=)',
    'megatron_orch.megatron.loss_func': '(loss_mask, output_tensor)',
    'megatron_orch.megatron.megatron_core_counts': '(consumed_samples, steps, samples_per_microbatch)',
    'megatron_orch.megatron.orch_config_from_args': '(args, verify_by_default=)',
    'megatron_orch.megatron.share_encoders': '(model, pipeline_group)',
    'megatron_orch.megatron.post_balance':
        '(forward_backward_func, data_iterator, spec, step, *, model=, config=, compute_device=, '
        'input_dtype=, timeout=, announce=)',
    'megatron_orch.megatron.BalanceableModel.phase_encoders': '(self)',
    'megatron_orch.megatron.BalanceableModel.encode': '(self, phase, items)',
    'megatron_orch.megatron.BalanceableModel.forward': '(self, batch, embeds=)',
    'megatron_orch.megatron.BalanceableModel.set_input_tensor': '(self, input_tensor)',
    'megatron_orch.trainer.task.TrainingTask':
        '(program, description, add_arguments, configure, build_model, forward_step, '
        'build_train_data_iterator, build_post_balancing, model_identity, data_identity=, '
        'check_data=)',
    'megatron_orch.trainer.task.ModelSummary':
        '(name, num_layers, phases, num_experts=, verify_first_step=, parameters=)',
    'megatron_orch.trainer.arguments.parse_args': '(task=, argv=, world_size=, extra_args_providers=)',
    'megatron_orch.trainer.arguments.parse_args_or_exit': '(task=, argv=, world_size=, extra_args_providers=)',
    'megatron_orch.trainer.arguments.check_data_or_exit': '(args, task=)',
    'megatron_orch.trainer.loop.pretrain': '(args, task=, print_fn=)',
}


def public_objects() -> dict:
    """Every public callable by its dotted name (the contract's protocol members too)."""
    import megatron_orch.megatron as hook
    import megatron_orch.trainer as trainer
    out = {f"megatron_orch.megatron.{name}": getattr(hook, name) for name in sorted(hook.__all__)}
    out.update({f"megatron_orch.megatron.BalanceableModel.{member}": getattr(hook.BalanceableModel, member)
                for member in ("phase_encoders", "encode", "forward", "set_input_tensor")})
    for module, names in trainer.PUBLIC.items():
        out.update({f"{module}.{name}": getattr(importlib.import_module(module), name) for name in names})
    return {name: obj for name, obj in out.items()
            if callable(obj) and not (inspect.isclass(obj) and issubclass(obj, BaseException))}


def shape(obj) -> str:
    """A signature as a caller depends on it: each parameter's name in order, ``=`` where it has a default,
    ``*``/``/`` where keyword-only / positional-only ones start, ``*args``/``**kwargs``."""
    parts, keyword_only = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            keyword_only = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        parts.append(p.name + ("=" if p.default is not p.empty else ""))
        if p.kind is p.POSITIONAL_ONLY:
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def _takes_every_old_call(recorded: str, now: str) -> bool:
    """Whether a signature of shape ``now`` takes every call one of shape ``recorded`` took: the same parameters
    in the same places, and only optional ones after them."""
    old, new = recorded[1:-1].split(", "), now[1:-1].split(", ")
    return new[:len(old)] == old and all(p.endswith("=") or p.startswith("**") or p == "*" for p in new[len(old):])


def test_the_public_signatures_take_every_recorded_call():
    got = {name: shape(obj) for name, obj in public_objects().items()}
    assert not set(SIGNATURES) - set(got), (f"public names gone: {set(SIGNATURES) - set(got)}; keep each for a "
                                             "release, with a DeprecationWarning naming what replaces it")
    broken = {name: (recorded, got[name]) for name, recorded in SIGNATURES.items()
              if not _takes_every_old_call(recorded, got[name])}
    assert not broken, ("public signatures changed (recorded, now): keep the old call working for a release "
                        f"with a DeprecationWarning naming the new one, then record the new one: {broken}")
    assert not set(got) - set(SIGNATURES), f"public names to record here: {set(got) - set(SIGNATURES)}"


def test_the_rule_refuses_what_breaks_a_call():
    assert _takes_every_old_call("(a, b=)", "(a, b=, c=)") and _takes_every_old_call("(a, b=)", "(a, b=, *, c=)")
    for now in ("(a, c, b=)", "(a, b=, c)", "(b=, a)", "(a, b)", "(a)", "(x, b=)"):
        assert not _takes_every_old_call("(a, b=)", now), now


def test_the_trainers_calls_from_before_tasks_still_work_with_a_deprecation_warning(monkeypatch):
    """parse_args / parse_args_or_exit without a task (positional and keyword), check_data_or_exit(args),
    pretrain(args) and the DDP classes the loop imported: the MLLM task they meant, each with a
    DeprecationWarning naming the call to write instead."""
    from megatron_orch.mllm.task import MLLM_TASK
    from megatron_orch.trainer import arguments

    argv = ["--seq-length", "192", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--distributed-backend", "gloo"]
    new = vars(arguments.parse_args(MLLM_TASK, argv, 2))
    for old_call in (lambda: arguments.parse_args(argv, 2), lambda: arguments.parse_args(argv, world_size=2),
                     lambda: arguments.parse_args(argv=argv, world_size=2), lambda: arguments.parse_args(argv, 2, ()),
                     lambda: arguments.parse_args_or_exit(argv, world_size=2)):
        with pytest.warns(DeprecationWarning, match=r"without a task is deprecated; call "
                                                    r"parse_args(_or_exit)?\(task, argv, world_size, \.\.\.\)"):
            assert vars(old_call()) == new
    with pytest.raises(TypeError, match=r"takes a TrainingTask, got int; call parse_args\(task"):
        arguments.parse_args(3)
    args = arguments.parse_args(MLLM_TASK, argv, 2)
    with pytest.warns(DeprecationWarning, match=r"check_data_or_exit\(args\) without a task is deprecated; call "
                                                r"check_data_or_exit\(args, task\)"):
        arguments.check_data_or_exit(args)

    from megatron.core import distributed

    from megatron_orch.trainer import loop
    for name in ("DistributedDataParallelConfig", "DistributedDataParallel"):
        with pytest.warns(DeprecationWarning, match=rf"loop\.{name} is deprecated: import it from "
                                                    r"megatron\.core\.distributed"):
            assert getattr(loop, name) is getattr(distributed, name)
    with pytest.raises(AttributeError):
        loop.no_such_name  # noqa: B018

    class Started(Exception):
        pass

    def initialize(args):
        raise Started
    monkeypatch.setattr(loop, "initialize", initialize)
    with pytest.warns(DeprecationWarning, match=r"pretrain\(args\) without a task is deprecated; call "
                                                r"pretrain\(args, task\)"), pytest.raises(Started):
        loop.pretrain(args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the task-first forms warn of nothing
        assert vars(arguments.parse_args(MLLM_TASK, argv, 2)) == new
        with pytest.raises(Started):
            loop.pretrain(args, MLLM_TASK)
