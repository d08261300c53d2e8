"""A model of one's own (``examples/own_model.py``: LLaVA-style, on megatron-core; ``examples/mimo_model.py``:
Megatron-Core's MimoModel): the mistakes that used to train silently differently or fail late are refused
before any collective, in one line naming the fix; a post-balancing step that reaches a stock schedule says
so; the flags of shadow mode and of the checked first step; docs/own_model.md's code is the examples' own.
Single-process (a gloo world of one); the multi-rank traps are in ``test_first_step.py``; post_balance's own choice of
the encoder layout with pipeline stages (its one collective's other ranks played by a patched all-reduce)."""
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import example_modules  # noqa: F401 -- examples/ on the path
from megatron_orch.mllm.task import MLLM_TASK

REPO = Path(__file__).resolve().parents[2]
OWN_MODEL_DOC = REPO / "docs" / "own_model.md"  # quotes the examples' code
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")


@pytest.fixture(scope="module")
def harness():
    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()


def _unread():
    """A data iterator that fails the test when read: a check that must come before any collective (the
    post-balancing iterator's first read gathers sizes over the DP group)."""
    raise AssertionError("the data iterator was read: the check came after the first collective")
    yield


def _schedule_call(model):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_orch.megatron import ModalityAwareSchedule, forward_step
    schedule = ModalityAwareSchedule(get_forward_backward_func(), dp_group=None)
    return schedule(forward_step_func=forward_step, data_iterator=_unread(), model=[model], num_microbatches=2)


def test_calculate_per_token_loss_is_required_before_the_first_collective(harness, world_of_one):
    """Without per-token normalisation balanced and upstream runs diverge (7.5e-3 in the loss): refused by the
    schedule itself, and by post_balance when it is given the model."""
    import own_model

    from megatron_orch.megatron import StepShape, post_balance

    vit, llm = own_model.shapes()
    model = own_model.TinyLlava(own_model.transformer_config(vit), own_model.transformer_config(llm, num_layers=1),
                                own_model.transformer_config(llm, calculate_per_token_loss=False))
    with pytest.raises(ValueError, match=r"needs calculate_per_token_loss=True .*--calculate-per-token-loss"):
        _schedule_call(model)
    with pytest.raises(ValueError, match="needs calculate_per_token_loss=True"):
        post_balance(None, _unread(), own_model.batch_spec(), StepShape(2, 2), model=[model])


def test_model_type_and_set_input_tensor_are_named_with_the_mixin(harness, world_of_one):
    """A model with phase_encoders, encode and forward but neither model_type nor set_input_tensor (the shape of
    the README's old example): megatron-core would fail inside its schedule, ``couldn't find attribute
    model_type``; refused before the first collective, naming both and the mixin that provides them."""
    import own_model
    from megatron.core.transformer.module import MegatronModule

    from megatron_orch.megatron import check_model

    class MyVLM(MegatronModule):
        def __init__(self):
            inner = own_model.build_model()
            super().__init__(config=inner.config)
            self.image_encoder, self.language_model = inner.image_encoder, inner.language_model

        phase_encoders = own_model.TinyLlava.phase_encoders
        encode = own_model.TinyLlava.encode
        forward = own_model.TinyLlava.forward

    with pytest.raises(TypeError, match=re.escape(
            "MyVLM lacks model_type, set_input_tensor of megatron_orch.megatron.BalanceableModel (inherit "
            "megatron_orch.megatron.MegatronModelMixin")):
        _schedule_call(MyVLM())
    model = own_model.build_model()  # with the mixin: both there, and set_input_tensor reaches the GPT
    assert check_model(model) is model and model.model_type.name == "encoder_or_decoder"
    model.set_input_tensor([None])


def test_packed_rows_with_mimo_are_refused_when_the_iterator_is_built(harness, world_of_one, monkeypatch):
    """Refused at build time, before the first collective of the iterator (it makes its communicator) and of
    post_balance (the DP group's topology, the communicator), not in the first forward after the step's moves.
    The example's MimoModel cannot take packed rows on either release: 0.16.1's forward takes no THD parameters;
    on 0.19 it does (packing_kwargs), but the example's language model is megatron-core's local GPT layer, whose
    DotProductAttention takes none (tests/megatron/test_mimo.py packs a MimoModel whose language model can)."""
    import torch.distributed as dist

    from example_modules import mimo_example
    from megatron_orch.balance.topology import Topology
    from megatron_orch.megatron import (OrchestratorConfig, ParallelGroups, PostBalancingDataIterator, StepShape,
                                        any_loop, post_balance, post_balancing)

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective before the refusal")

    for module, name in ((post_balancing, "dedicated_group"), (any_loop, "dedicated_group"),
                         (any_loop, "group_topology")):
        monkeypatch.setattr(module, name, no_collective)
    spec = mimo_example().spec_of(mimo_example().build())
    packed = OrchestratorConfig(microbatching="packed")
    from megatron_orch.megatron import mimo

    assert spec.cannot_pack == (mimo.CANNOT_PACK_ATTENTION.format("DotProductAttention")
                                if mimo.takes_packing_kwargs(mimo_example().build().mimo) else mimo.CANNOT_PACK)
    refusal = "OrchestratorConfig.microbatching packed: MimoBalancing does not hand packed rows to this MimoModel"
    with pytest.raises(ValueError, match=refusal):
        PostBalancingDataIterator(_unread(), spec, packed, StepShape(2, 2),
                                  ParallelGroups(dist.group.WORLD, Topology.uniform(1, 1)),
                                  compute_device=torch.device("cpu"))
    with pytest.raises(ValueError, match=refusal):
        post_balance(None, _unread(), spec, StepShape(2, 2), config=packed)


def test_a_balanced_step_reaching_a_stock_schedule_says_so(harness, world_of_one):
    """megatron-core's own schedule handed the post-balancing iterator (no modality-aware schedule around it):
    the project's forward_step, and a user's that reads the step as a micro-batch, raise StockScheduleError."""
    import numpy as np
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import own_model
    from megatron_orch.megatron import BalancedStep, StockScheduleError, forward_step

    step = BalancedStep(microbatches=[], inputs={}, plan=None, rank=0, num_tokens=np.zeros(0, dtype=np.int64),
                        rows_per_item={}, comm_group=None, moves=None)

    def users_forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch.to(torch.device("cpu"))), None

    for step_func in (forward_step, users_forward_step):
        with pytest.raises(StockScheduleError, match="reached megatron-core's own schedule .*ModalityAwareSchedule"):
            get_forward_backward_func()(forward_step_func=step_func, data_iterator=iter([step]),
                                        model=[own_model.build_model()], num_microbatches=1, seq_length=8,
                                        micro_batch_size=1, forward_only=True)
    with pytest.raises(StockScheduleError):
        step["tokens"]


def test_shadow_and_checked_first_step_flags(tmp_path):
    """--orch-shadow is a switch of its own (exclusive with --orch-post-balancing, taking the planner's flags);
    the first step is checked by default for a model config outside configs/, not for the shipped ones."""
    from megatron_orch.trainer import arguments

    common = ["--seq-length", "192", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
              "--distributed-backend", "gloo"]
    shadow = arguments.parse_args(MLLM_TASK, common + ["--orch-shadow", "--orch-locality"], world_size=2).orch_config
    assert shadow.shadow and shadow.locality and not shadow.verify_first_step
    with pytest.raises(arguments.ArgumentError, match="--orch-shadow and --orch-post-balancing exclude each other"):
        arguments.parse_args(MLLM_TASK, common + ["--orch-shadow", "--orch-post-balancing"], world_size=2)
    with pytest.raises(arguments.ArgumentError, match="--orch-verify-first-step given without --orch-post-balancing"):
        arguments.parse_args(MLLM_TASK, common + ["--orch-verify-first-step"], world_size=2)
    shipped = arguments.parse_args(MLLM_TASK, common + ["--orch-post-balancing"], world_size=2).orch_config
    checked = arguments.parse_args(MLLM_TASK, common + ["--orch-post-balancing", "--orch-verify-first-step"], world_size=2)
    assert not shipped.verify_first_step and checked.orch_config.verify_first_step
    (tmp_path / "mine.yaml").write_text((REPO / "configs" / "tiny.yaml").read_text())  # a config of one's own
    own = ["--model-config", str(tmp_path / "mine.yaml")]
    own_config = arguments.parse_args(MLLM_TASK, common + own + ["--orch-post-balancing"], world_size=2).orch_config
    unchecked = arguments.parse_args(MLLM_TASK, common + own + ["--orch-post-balancing", "--orch-no-verify-first-step"],
                                     world_size=2).orch_config
    assert own_config.verify_first_step and not unchecked.verify_first_step


def _regions():
    """(example file, region) of every ``# readme: REGION`` ... ``# readme: end`` in examples/."""
    return [(f"examples/{path.name}", region) for path in sorted((REPO / "examples").glob("*.py"))
            for region in re.findall(r"^ *# readme: (\w+)$", path.read_text(), re.M) if region != "end"]


@pytest.mark.parametrize("path,region", _regions())
def test_the_own_model_page_quotes_the_examples(path, region):
    """docs/own_model.md's code is excerpted from the examples (which CI runs), so it cannot go stale: every
    region the examples mark is quoted once, verbatim (dedented), after ``<!-- excerpt: FILE REGION -->``."""
    source = (REPO / path).read_text()
    match = re.search(rf"^( *)# readme: {region}\n(.*?)^\1# readme: end\n", source, re.S | re.M)
    assert match, f"{path}: region {region} has no end"
    quoted = re.findall(rf"<!-- excerpt: {re.escape(path)} {region} -->\n```python\n(.*?)```",
                        OWN_MODEL_DOC.read_text(), re.S)
    assert len(quoted) == 1, f"docs/own_model.md quotes {path} {region} {len(quoted)} times"
    assert quoted[0] == textwrap.dedent(match.group(2)), f"docs/own_model.md's {path} {region} differs from the file"


def test_every_excerpt_of_the_own_model_page_names_a_region():
    readme = OWN_MODEL_DOC.read_text()
    assert set(re.findall(r"<!-- excerpt: (\S+) (\S+) -->", readme)) == set(_regions())


def _images_from_step_2():
    """Two steps of a world of one (two micro-batches of two examples each): the first without images, the
    second with at least one in each micro-batch."""
    import own_model
    spec = own_model.batch_spec()
    examples = [own_model.example(i) for i in range(100)]
    steps = ([e for e in examples if e.num_items("image") == 0][:4], [e for e in examples if e.num_items("image")][:4])
    for chosen in steps:
        for m in range(2):
            yield own_model.collate(chosen[2 * m:2 * m + 2], spec)


def _train_two_steps(model_class, verify: bool):
    """own_model's loop on :func:`_images_from_step_2`, balanced; the losses, the parameters after, the
    steps completed (two unless refused) and the refusal."""
    import own_model
    from megatron_orch.megatron import OrchestratorConfig

    torch.manual_seed(7)
    module = own_model.build_model(model_class)
    model, optimizer, schedule, data = own_model.setup(module, _images_from_step_2(), own_model.batch_spec(), True,
                                                       config=OrchestratorConfig(verify_first_step=verify))
    losses, refusal = [], None
    try:
        for _ in range(2):
            losses.append(own_model.train_step(schedule, data, model, optimizer))
    except (ValueError, RuntimeError) as err:
        refusal = err
    return {"losses": losses, "refusal": refusal,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def _tiny_llava_variants():
    """TinyLlava with BatchNorm over its image rows (a statistic across the items of one call), with it and
    dropout, and with the upstream branch of forward encoding under torch.no_grad()."""
    import own_model

    class BatchNormed(own_model.TinyLlava):
        def __init__(self, *configs):
            super().__init__(*configs)
            self.image_encoder.norm = torch.nn.BatchNorm1d(self.config.hidden_size)

        def encode(self, phase, items):
            rows = super().encode(phase, items)
            return self.image_encoder.norm(rows) if rows.shape[0] else rows

    class BatchNormedWithDropout(BatchNormed):
        def __init__(self, *configs):
            super().__init__(*configs)
            self.image_encoder.dropout = torch.nn.Dropout(0.1)

        def encode(self, phase, items):
            return self.image_encoder.dropout(super().encode(phase, items))

    class FrozenUpstream(own_model.TinyLlava):
        def forward(self, batch, embeds=None):
            if embeds is None:
                with torch.no_grad():
                    embeds = {"image": self.encode("image", batch.items["image"])}
            return super().forward(batch, embeds)

    return BatchNormed, BatchNormedWithDropout, FrozenUpstream


def test_each_phase_is_checked_on_its_first_step_in_training_mode(harness, world_of_one, capsys):
    """The image phase first comes at step 2: a correct model is checked then too (a second checked step, which
    trains what the unchecked run trains); a BatchNorm encoder (also with dropout, which must not turn the
    check to eval mode, where BatchNorm uses its running statistics) and an encoder under torch.no_grad() in
    the upstream branch only are refused at step 2, naming the phase, where they used to train differently."""
    batch_normed, with_dropout, frozen_upstream = _tiny_llava_variants()
    checked, unchecked = _train_two_steps(None, True), _train_two_steps(None, False)
    assert checked["refusal"] is None and checked["losses"] == unchecked["losses"]
    for name, value in unchecked["params"].items():
        assert torch.equal(checked["params"][name], value), name
    lines = re.findall(r"> post-balancing: step checked \(--orch-verify-first-step, phases ([\w, ]+), training mode\)",
                       capsys.readouterr().out)
    assert lines == ["text", "text, image"]
    for model_class in (batch_normed, with_dropout):
        got = _train_two_steps(model_class, True)
        assert len(got["losses"]) == 1 and re.search(
            r"encode\('image', items\) is not item by item: .* in training mode", str(got["refusal"])), got
    got = _train_two_steps(frozen_upstream, True)
    assert len(got["losses"]) == 1 and re.search(
        r"phase 'image''s encoder gets gradients in the balanced layout of the same batch but none in the "
        r"loader's: .*torch\.no_grad\(\)", str(got["refusal"])), got


def test_packing_is_the_models_to_opt_into(harness, world_of_one):
    """A BatchSpec that says nothing of packing gets equal-count micro-batches under ``auto`` (with the reason),
    and ``packed`` is refused; one that says takes_packed_rows=True while its forward ignores the rows' bounds
    is stopped by the checked step, whose message names the packed rows first."""
    import dataclasses

    import own_model
    from megatron_orch.megatron import FirstStepMismatchError, OrchestratorConfig, StepShape
    from megatron_orch.megatron.post_balancing import resolve_microbatching

    silent = dataclasses.replace(own_model.batch_spec(), cannot_pack=None)
    resolved, why = resolve_microbatching(silent, OrchestratorConfig(), StepShape(2, 2))
    assert resolved.microbatching == "equal_count" and "takes_packed_rows=False" in why
    with pytest.raises(ValueError, match=r"OrchestratorConfig.microbatching packed: its BatchSpec leaves takes_packed_rows=False"):
        resolve_microbatching(silent, OrchestratorConfig(microbatching="packed"), StepShape(2, 2))
    claims = dataclasses.replace(silent, takes_packed_rows=True)
    assert resolve_microbatching(claims, OrchestratorConfig(), StepShape(2, 2)) == (
        OrchestratorConfig(microbatching="packed"), None)
    with pytest.raises(ValueError, match="contradict"):
        dataclasses.replace(claims, cannot_pack="no")

    torch.manual_seed(7)
    module = own_model.build_model()
    model, optimizer, schedule, data = own_model.setup(module, own_model.microbatches(claims, 0, 1, 1), claims, True)
    with pytest.raises(FirstStepMismatchError, match=r"differs between the loader's and the balanced layout .*; the "
                       r"balanced micro-batches are packed rows .*takes_packed_rows False or pass "
                       r"--orch-microbatching equal_count"):
        own_model.train_step(schedule, data, model, optimizer)


def test_a_forward_that_ignores_embeds_is_refused_by_name(harness, world_of_one):
    """A forward that encodes batch.items whatever it is given (torch's bare shape error inside the backbone,
    checked or not), or that fills the placeholders with something else than embeds (no error at all): refused
    naming the phase whose embeds it did not read."""
    import own_model
    from megatron_orch.megatron import OrchestratorConfig

    class IgnoresEmbeds(own_model.TinyLlava):
        def forward(self, batch, embeds=None):
            return super().forward(batch, None)

    class ZerosForEmbeds(own_model.TinyLlava):
        def forward(self, batch, embeds=None):
            if embeds is not None:
                rows = int((batch.tokens == own_model.IMAGE_TOKEN).sum())
                embeds = {"image": torch.zeros(rows, self.config.hidden_size)}
            return super().forward(batch, embeds)

    spec = own_model.batch_spec()
    for model_class, verify in ((IgnoresEmbeds, True), (IgnoresEmbeds, False), (ZerosForEmbeds, False)):
        torch.manual_seed(7)
        model, optimizer, schedule, data = own_model.setup(
            own_model.build_model(model_class), own_model.microbatches(spec, 0, 1, 1), spec, True,
            config=OrchestratorConfig(verify_first_step=verify))
        with pytest.raises(ValueError, match=rf"{model_class.__name__}\.forward\(batch, embeds\) did not read "
                                             r"embeds\['image'\] of a micro-batch holding \d+ of its rows"):
            own_model.train_step(schedule, data, model, optimizer)


def test_shadow_mode_in_ones_own_loop_reaches_its_log(harness, world_of_one):
    """post_balance(config=OrchestratorConfig(shadow=True)) in own_model's loop: every step's plan figures
    reach the loop's ``announce`` as a line and the schedule's ``shadow_figures``, the plan's own report."""
    import own_model
    from megatron_orch.megatron import OrchestratorConfig, StepShape, post_balance
    from megatron_orch.megatron.post_balancing import ShadowStep

    lines, steps = [], []
    spec = own_model.batch_spec()
    torch.manual_seed(7)
    module = own_model.build_model()
    model, optimizer, _, data = own_model.setup(module, own_model.microbatches(spec, 0, 1, 2), spec, False)
    schedule, iterator = post_balance(own_model.get_forward_backward_func(), data, spec, StepShape(2, 2),
                                      model=model, config=OrchestratorConfig(shadow=True), announce=lines.append)

    def recorded():
        for step in iterator:
            assert isinstance(step, ShadowStep)
            steps.append(step)
            yield step

    data = recorded()
    for _ in range(2):
        own_model.train_step(schedule, data, model, optimizer)
        assert schedule.shadow_figures == steps[-1].plan.report()
    assert len(lines) == 2 and all(line.startswith("> post-balancing shadow (planned, not applied) cost max/mean "
                                                   "over DP before->after: image ") for line in lines), lines
    figures = steps[-1].plan.report()
    assert f"text {figures['text before']:.2f}->{figures['text after']:.2f}" in lines[-1]


def _functional_dropout_variants():
    """TinyLlava with dropout written as torch's functions at literal rates (no module, no rate attribute for the
    check to find): in encode, from a name bound at import, in forward as torch.dropout, and inside attention
    (scaled_dot_product_attention's dropout_p); and the BatchNorm encoder of :func:`_tiny_llava_variants` with
    such a dropout."""
    import own_model
    from torch.nn.functional import dropout as bound_dropout
    batch_normed, _, _ = _tiny_llava_variants()

    class FunctionalDropout(own_model.TinyLlava):
        def encode(self, phase, items):
            rows = torch.nn.functional.dropout(super().encode(phase, items), 0.1, training=True)
            return bound_dropout(rows, p=0.2)

        def forward(self, batch, embeds=None):
            if embeds is not None:
                embeds = {phase: torch.dropout(rows, 0.1, True) for phase, rows in embeds.items()}
            return super().forward(batch, embeds)

    class AttentionDropout(own_model.TinyLlava):
        def encode(self, phase, items):
            rows = super().encode(phase, items)
            if rows.shape[0] == 0:
                return rows
            q = rows.reshape(rows.shape[0], 1, 1, -1)  # each row attends to itself alone: item by item
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, None, 0.3).reshape(rows.shape)

    class BatchNormedWithFunctionalDropout(batch_normed):
        def encode(self, phase, items):
            return torch.nn.functional.dropout(super().encode(phase, items), 0.1)

    return FunctionalDropout, AttentionDropout, BatchNormedWithFunctionalDropout


def test_functional_dropout_at_a_literal_rate_is_off_for_the_check(harness, world_of_one):
    """Dropout called as a function at a literal rate is off for the checks as a dropout module is: the checked
    steps pass where the model is right (a mask drawn per layout would make them differ), and a model that is
    wrong is still refused by name."""
    functional, attention, batch_normed = _functional_dropout_variants()
    for model_class in (functional, attention):
        got = _train_two_steps(model_class, True)
        assert got["refusal"] is None and len(got["losses"]) == 2, (model_class.__name__, got["refusal"])
    got = _train_two_steps(batch_normed, True)
    assert len(got["losses"]) == 1 and re.search(
        r"encode\('image', items\) is not item by item: .* in training mode", str(got["refusal"])), got


def test_a_forward_that_detaches_embeds_is_refused_at_its_phases_first_step(harness, world_of_one):
    """The reverse of the upstream branch under torch.no_grad(): forward(batch, embeds) detaches the embeddings,
    so the encoder trains upstream and not balanced; refused at step 2 (the first with images), naming the phase."""
    import own_model

    class DetachesEmbeds(own_model.TinyLlava):
        def forward(self, batch, embeds=None):
            if embeds is not None:
                embeds = {phase: rows.detach() for phase, rows in embeds.items()}
            return super().forward(batch, embeds)

    got = _train_two_steps(DetachesEmbeds, True)
    assert len(got["losses"]) == 1 and re.search(
        r"phase 'image''s encoder gets gradients in the loader's layout of the same batch but none in the "
        r"balanced", str(got["refusal"])), got


def test_a_ramped_global_batch_in_ones_own_loop_trains_as_upstream(harness, world_of_one):
    """A global batch that grows from step to step (1, 2, then 3 micro-batches): post_balance with
    ``StepShape.of_steps`` loads each step's count, plans it over that global batch, and the loop passes the
    schedule each step's count; the losses are upstream's (megatron-core's schedule over the same loader)."""
    import own_model

    from megatron_orch.megatron import OrchestratorConfig, StepShape, post_balance
    from megatron_orch.megatron.batch import collate

    counts, spec = [1, 2, 3, 3], own_model.batch_spec()

    def loader():
        examples = iter(range(10_000))
        for count in counts:
            for _ in range(count):
                yield collate([own_model.example(next(examples)) for _ in range(own_model.MICRO_BATCH)], spec)

    def train(balanced: bool):
        torch.manual_seed(7)
        module = own_model.build_model()
        model, optimizer, schedule, data = own_model.setup(module, loader(), spec, False)
        if balanced:
            schedule, data = post_balance(schedule, data, spec, StepShape.of_steps(own_model.MICRO_BATCH, counts),
                                          model=model, config=OrchestratorConfig(verify_first_step=False))
        losses, ran = [], []  # ran: the micro-batches of each balanced step
        for count in counts:
            losses.append(own_model.train_step(schedule, data, model, optimizer, count))
            ran += [len(schedule.last_step.microbatches)] if balanced else []
        return losses, ran

    upstream, _ = train(False)
    balanced, ran = train(True)
    assert ran == counts
    torch.testing.assert_close(balanced, upstream, rtol=1e-5, atol=0)


def test_post_balance_decides_the_encoder_layout_with_pipeline_stages_in_one_collective(harness, world_of_one,
                                                                                      monkeypatch):
    """``post_balance``'s own ``AUTO`` decision with 2 pipeline stages (its ``_decide_encoder_ranks``, given the
    sizes; a world of one stands for the job, the one collective's other ranks played by a patched all-reduce):
    ``ALL`` where every rank's model holds encoders, ``FIRST_STAGE`` where any rank's holds none (the minimum over
    the job), where no model is given or in shadow mode; the line says which and why, and nothing is announced
    where both layouts are one (PP 1 at the backbone's TP)."""
    import own_model
    from megatron_orch.megatron import OrchestratorConfig, any_loop
    from megatron_orch.orchestrator.config import EncoderRanks

    torch.manual_seed(7)
    model = [own_model.build_model()]
    assert model[0].phase_encoders()
    others_hold = []  # what the job's other ranks report: 1.0 holds encoders, 0.0 holds none
    real_all_reduce = any_loop.dist.all_reduce

    def all_reduce(tensor, op=None, **kwargs):
        assert op == any_loop.dist.ReduceOp.MIN, op
        real_all_reduce(tensor, op=op, **kwargs)
        for value in others_hold:
            tensor.copy_(torch.minimum(tensor, torch.full_like(tensor, value)))

    monkeypatch.setattr(any_loop.dist, "all_reduce", all_reduce)

    def decide(config=OrchestratorConfig(), given=model, pp=2, tp=1):
        lines = []
        decided = any_loop._decide_encoder_ranks(config, given, None, tp, pp, lines.append)
        return decided.encoder_ranks, lines

    ranks, lines = decide()
    assert ranks is EncoderRanks.ALL and len(lines) == 1 and "auto: all" in lines[0], lines
    others_hold[:] = [1.0, 0.0]  # one other rank's model was built without encoders
    ranks, lines = decide()
    assert ranks is EncoderRanks.FIRST_STAGE and "holds no encoders off the first pipeline stage" in lines[0], lines
    others_hold[:] = [1.0]
    ranks, lines = decide(given=None)
    assert ranks is EncoderRanks.FIRST_STAGE and "given no model" in lines[0], lines
    ranks, lines = decide(config=OrchestratorConfig(shadow=True))
    assert ranks is EncoderRanks.FIRST_STAGE and "shadow mode" in lines[0], lines
    ranks, lines = decide(pp=1)
    assert ranks is EncoderRanks.FIRST_STAGE and lines == [], lines
