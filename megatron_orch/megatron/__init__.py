"""The hook a Megatron-LM user imports: post-balancing around Megatron's own training loop, for any model
that meets its contract (:mod:`megatron_orch.megatron.contract`: phases as data, what a batch provides,
what the model provides, what ``forward_step`` receives).

* :class:`PostBalancingDataIterator` wraps the training data iterator: per global batch it gathers
  sizes over the DP group, plans every phase and moves the data, and yields one :class:`BalancedStep`;
* :class:`ModalityAwareSchedule` wraps ``get_forward_backward_func()``: encoders over the rank's
  balanced items, their outputs to the backbone rank of their example, Megatron's schedule for the
  backbone, then the encoders' backward before gradients are finalised;
* :func:`post_balance` wraps both for any loop that calls megatron-core's schedule itself (your own,
  Megatron-Bridge's shape): :mod:`megatron_orch.megatron.any_loop` says which model-config callbacks it needs;
  :func:`megatron_core_counts` gives a batch-size ramp-up's per-step micro-batches (``StepShape.of_steps``);
* :mod:`~megatron_orch.megatron.first_step`: the model's mistakes refused before training or on the first
  step, and the checked first step (the loader's against the balanced layout of one batch);
* :class:`MimoBalancing` makes Megatron-Core's ``MimoModel`` such a model;
* the ``--orch-*`` flags (:func:`add_orch_args`, Megatron's ``extra_args_provider`` convention) and
  the config they build (:func:`orch_config_from_args`).

Inside Megatron-LM's own loop: :mod:`megatron_orch.megatron.megatron_lm`.
"""
import importlib

# Names are imported on first use (PEP 562), so that ``megatron_orch.megatron.orch_arguments`` (the
# --orch-* flags) imports without torch: pretrain_mllm.py checks its command line before torch loads.
_EXPORTS = {
    "megatron_orch.balance.cost": ("CostModel", "FunctionCost", "TransformerCost", "TransformerShape",
                                   "ProjectorShape"),
    "megatron_orch.balance.cost_profile": ("CostProfile", "ProfileCost", "load_cost_profile"),
    "megatron_orch.balance.topology": ("Topology",),
    "megatron_orch.balance.workload": ("BackbonePhase", "EncoderPhase", "ModelPhases"),
    "megatron_orch.comm.group_topology": ("group_topology",),
    "megatron_orch.orchestrator.config": ("OrchestratorConfig",),
    "megatron_orch.megatron.batch": ("BatchSpec", "EncoderInput", "Example", "ExampleSizes", "MicroBatch",
                                     "collate", "collate_packed"),
    "megatron_orch.megatron.any_loop": ("megatron_core_counts", "post_balance"),
    "megatron_orch.megatron.contract": ("BalanceableModel", "MegatronModelMixin", "check_model", "forward_step",
                                        "loss_func"),
    "megatron_orch.megatron.encoder_layout": ("share_encoders",),
    "megatron_orch.megatron.first_step": ("FirstStepMismatchError",),
    "megatron_orch.megatron.mimo": ("MimoBalancing", "MimoModality"),
    "megatron_orch.megatron.orch_arguments": ("add_orch_args", "orch_config_from_args"),
    "megatron_orch.megatron.post_balancing": ("BalancedMicroBatch", "BalancedStep", "ParallelGroups",
                                              "PostBalancingDataIterator", "ShadowStep", "StepShape",
                                              "StockScheduleError"),
    "megatron_orch.megatron.schedule": ("ModalityAwareSchedule",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
