"""Consequence invariance in the layouts large runs use, on the compact trainer, CPU over gloo: sequence
parallelism (TP 2 + SP x DP 2, also with the encoders at TP 1 on every rank), context parallelism (CP 2 x DP 2,
padded rows and packed rows), both (TP 2 + SP x CP 2 x DP 2, 8 ranks, one step), and the encoders on every pipeline
stage (``--orch-encoder-ranks all``: PP 2 x DP 2, the encoder phases over 4 ranks; TP 2 x PP 2 x DP 2 with the
encoders at TP 1, over 8 encoder replicas, its moves node-wise, 8 ranks, one step; PP 2 x VPP 2 x DP 2, in every rank's first model
chunk, one step; each with its first step checked against the loader's layout). Post-balancing off against on, fp32, dropout 0 (dropout masks
follow the rank that computes an example): the losses of every step and every parameter after the run agree
within 1e-5, and on the step with every heavy example on DP rank 0 the plan moved data and lowered each
phase's modeled max/mean. The layouts also reproduce the whole-sequence run: SP on against off, CP 2 against
CP 1 at the same global batch (the shards are exact).

The runs of one layout share their spawned ranks (one after the other), to start the processes once. The
data is ``test_post_balancing``'s scripted stream from its heavy step on.
"""
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import TRAINED_PARAMS_ATOL, run_distributed
from test_post_balancing import SCENARIOS, scripted_example
from megatron_orch.mllm.task import MLLM_TASK

pytestmark = pytest.mark.distributed
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

FIRST_STEP = SCENARIOS.index("heavy_on_one_rank")  # then "mixed"
MBS, NUM_MB, DP = 2, 2, 2
COMMON = ["--model-config", "tiny", "--seq-length", "192", "--micro-batch-size", str(MBS),
          "--global-batch-size", str(MBS * NUM_MB * DP), "--lr", "1e-2", "--lr-warmup-iters", "0",
          "--log-interval", "1", "--seed", "5", "--distributed-backend", "gloo", "--optimizer", "sgd",
          "--hidden-dropout", "0", "--attention-dropout", "0"]
BALANCED = ["--orch-post-balancing", "--orch-gpus-per-node", "2"]
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP = ["--context-parallel-size", "2"]
TOLERANCE = 1e-5


def scripted_iterator(args, consumed_samples, dp_rank, dp_size):
    """This DP rank's micro-batches of the scripted stream from its heavy step on (same on its TP/CP/PP peers)."""
    from megatron_orch.megatron.batch import collate
    from megatron_orch.mllm import providers

    data = providers.data_config(args)
    spec, per_rank = data.layout.spec, MBS * args.num_microbatches
    for step in range(consumed_samples // args.global_batch_size, args.train_iters):
        for m in range(args.num_microbatches):
            examples = [scripted_example(FIRST_STEP + step, dp_rank, m * MBS + j, spec,
                                         step * args.global_batch_size + dp_rank * per_rank + m * MBS + j)
                        for j in range(MBS)]
            yield collate(examples, spec, pad_to=data.seq_length if data.pad_to_seq_length else None)


def _train_runs(rank, world_size, runs, out_dir):
    """Each run ``(name, argv)`` in turn in these ranks: rank 0's parameters (TP rank 0, CP rank 0 of the first
    DP replica: the same shards in every layout of its TP size) and the logging rank's records."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.megatron import first_step
    from megatron_orch.mllm import attention, providers
    from megatron_orch.trainer import arguments, loop as trainer

    providers.build_train_data_iterator = scripted_iterator
    stock_attention, stock_check = attention.context_parallel_attention, first_step.checked_step
    stock_wrap = trainer.wrap_data_parallel
    for name, argv in runs:
        built, calls, checks, wrapped = [], {"padded": 0, "packed": 0}, [], []

        def wrap_data_parallel(*args, **kwargs):  # the model chunks as Megatron DDP reduces their gradients
            wrapped.append(stock_wrap(*args, **kwargs))
            return wrapped[-1]

        trainer.wrap_data_parallel = wrap_data_parallel

        def checked_step(*args, **kwargs):  # the checked first steps' figures (the same on every rank)
            result, figures = stock_check(*args, **kwargs)
            checks.append(figures)
            return result, figures

        first_step.checked_step = checked_step

        def context_parallel_attention(*args, **kwargs):  # which CP path the run took
            calls["packed" if args[4] is not None else "padded"] += 1
            return stock_attention(*args, **kwargs)

        attention.context_parallel_attention = context_parallel_attention

        def model_provider(args, pre_process, post_process, vp_stage=None):
            built.append(providers.build_model(args, pre_process, post_process, vp_stage))
            return built[-1]

        args = arguments.parse_args(MLLM_TASK, COMMON + list(argv), world_size=world_size)
        try:
            task = dataclasses.replace(MLLM_TASK, build_model=model_provider)
            records = trainer.pretrain(args, task, print_fn=lambda line: None)
        finally:
            parallel_state.destroy_model_parallel()
        out = Path(out_dir) / name
        out.mkdir(exist_ok=True)
        params = {f"chunk{k}.{n}" if k else n: p.detach().clone()  # a later model chunk's names prefixed
                  for k, chunk in enumerate(built) for n, p in chunk.named_parameters()}
        torch.save(params, out / f"params_rank{rank}.pt")
        torch.save([(chunk.ddp_config.overlap_grad_reduce, chunk.ddp_config.use_distributed_optimizer,
                     len(chunk.bucket_groups)) for chunk in wrapped], out / f"ddp_rank{rank}.pt")
        if records:
            config = built[0].config  # the backbone's: what its layers were built for
            torch.save({"losses": {r.iteration: r.lm_loss for r in records},
                        "grad_norms": {r.iteration: r.grad_norm for r in records},
                        "post_balancing": [r.post_balancing for r in records],
                        "items_encoded": [r.items_encoded for r in records],
                        "layout": (config.sequence_parallel, config.context_parallel_size),
                        "cp_attention_calls": calls, "checks": checks}, out / "log.pt")
    attention.context_parallel_attention, first_step.checked_step = stock_attention, stock_check
    trainer.wrap_data_parallel = stock_wrap


def train(tmp_path: Path, world_size: int, runs, timeout_s: float) -> dict:
    """``runs``: ``(name, flags)`` trained one after the other in one spawn of ``world_size`` ranks."""
    run_distributed(_train_runs, world_size, [(name, list(flags)) for name, flags in runs], str(tmp_path),
                    timeout_s=timeout_s)
    logs = {}
    for name, _ in runs:
        logs[name] = torch.load(tmp_path / name / "log.pt")
        logs[name]["params"] = torch.load(tmp_path / name / "params_rank0.pt")
        logs[name]["params_of_rank"] = lambda rank, name=name: torch.load(tmp_path / name / f"params_rank{rank}.pt")
        logs[name]["ddp_of_rank"] = lambda rank, name=name: torch.load(tmp_path / name / f"ddp_rank{rank}.pt")
    return logs


def assert_same_run(got: dict, want: dict, iterations: int, what: str):
    """Equal losses at every iteration and equal parameters (rank 0's) within :data:`TOLERANCE`; prints the
    largest differences (``pytest -s`` shows them)."""
    assert sorted(got["losses"]) == sorted(want["losses"]) == list(range(1, iterations + 1))
    for iteration, loss in want["losses"].items():
        assert got["losses"][iteration] == pytest.approx(loss, rel=TOLERANCE), (iteration, got["losses"],
                                                                                 want["losses"])
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=TOLERANCE, atol=TRAINED_PARAMS_ATOL,
                                   msg=lambda m: f"parameter {name}: {m}")
    loss = max(abs(got["losses"][i] - want["losses"][i]) / abs(want["losses"][i]) for i in want["losses"])
    param = max(float((got["params"][n] - v).abs().max()) for n, v in want["params"].items())
    print(f"{what}: largest relative loss difference {loss:.1e}, largest parameter difference {param:.1e}")


def assert_same_encoder_tp1_run(got: dict, want: dict, iterations: int, what: str):
    """:func:`assert_same_run` of a run with the encoders at TP 1 against one at TP 2 (global ranks 0 and 1: TP
    ranks 0 and 1 of the first replica): an encoder parameter TP 2 splits against its half of the whole TP-1 one;
    the gradient norms agree too (every encoder replica but the first marked shared)."""
    for tp_rank in (0, 1):
        expected, params = want["params_of_rank"](tp_rank), got["params_of_rank"](tp_rank)
        assert params.keys() == expected.keys()
        split = {name: [d for d in range(value.dim()) if value.shape[d] != expected[name].shape[d]]
                 for name, value in params.items()}
        assert any(split.values())  # the encoders are at TP 1
        for name, dims in split.items():
            if dims:
                assert name.startswith("encoders.") and params[name].shape[dims[0]] == 2 * expected[name].shape[dims[0]]
                params[name] = params[name].chunk(2, dim=dims[0])[tp_rank]
        assert_same_run(dict(got, params=params), dict(want, params=expected), iterations, f"{what}, TP rank {tp_rank}")
    for iteration, norm in want["grad_norms"].items():
        assert got["grad_norms"][iteration] == pytest.approx(norm, rel=TOLERANCE), (got["grad_norms"],
                                                                                     want["grad_norms"])


def assert_first_step_checked(logs: dict, run: str = "all"):
    """The ``run``'s first step checked against the loader's layout (``--orch-verify-first-step``: the loss, the
    gradient norms, the encoder outputs within :data:`TOLERANCE`); the upstream run unchecked."""
    check, = logs[run]["checks"]  # the first step holds items of every phase
    assert check["loss"] <= TOLERANCE and check["gradient norms"] <= TOLERANCE, check
    assert check["encoder outputs"].keys() == {"vision", "audio"}, check
    assert max(check["encoder outputs"].values()) <= TOLERANCE, check
    assert logs["upstream"]["checks"] == []


def assert_plan_balances(balanced: dict):
    """The heavy step (the first): the plan moved data off DP rank 0 and lowered every phase's max/mean."""
    heavy = balanced["post_balancing"][0]
    assert heavy["intra-node MB"] + heavy["inter-node MB"] > 0, heavy
    for phase in ("vision", "audio", "llm"):
        assert heavy[f"{phase} before"] > 1.3, heavy
        assert heavy[f"{phase} after"] < heavy[f"{phase} before"], heavy
    print("heavy step, modeled max/mean before->after: " + ", ".join(
        f"{p} {heavy[f'{p} before']:.2f}->{heavy[f'{p} after']:.2f}" for p in ("vision", "audio", "llm")) +
        f"; moved MB {heavy['intra-node MB'] + heavy['inter-node MB']:.3f}")


def test_tp2_sequence_parallel_dp2_is_invariant_and_equals_tp2(tmp_path):
    iters = ["--train-iters", "2"]
    logs = train(tmp_path, 4, [("upstream", SP + iters), ("balanced", SP + iters + BALANCED),
                               ("tp2", SP[:2] + iters),
                               ("encoder_tp1", SP + iters + BALANCED + ["--orch-encoder-ranks", "all",
                                                                       "--orch-encoder-tensor-parallel-size", "1"])],
                 timeout_s=420)
    assert logs["balanced"]["layout"] == logs["upstream"]["layout"] == (True, 1) and logs["tp2"]["layout"] == (False, 1)
    assert_same_run(logs["balanced"], logs["upstream"], 2, "TP 2 + SP x DP 2, post-balancing on / off")
    assert_plan_balances(logs["balanced"])
    assert_same_run(logs["upstream"], logs["tp2"], 2, "TP 2 + SP / TP 2")  # sequence parallelism changes no number
    assert logs["upstream"]["losses"][2] != logs["upstream"]["losses"][1]
    # PP 1, the encoders at TP 1: 4 encoder replicas, each backbone TP rank's embeddings by the one all-to-all
    assert_same_encoder_tp1_run(logs["encoder_tp1"], logs["upstream"], 2,
                                "TP 2 + SP x DP 2, encoders at TP 1 / upstream")
    assert all(len(step["vision"]) == 4 and max(step["vision"]) - min(step["vision"]) <= 1
               for step in logs["encoder_tp1"]["items_encoded"]), logs["encoder_tp1"]["items_encoded"]


@pytest.fixture(scope="module")
def dp2_whole(tmp_path_factory):
    """The whole-sequence run at the same global batch (CP 1 x DP 2): what CP 2 x DP 2 must reproduce."""
    return train(tmp_path_factory.mktemp("dp2"), 2, [("dp2", ["--train-iters", "2"])], timeout_s=240)["dp2"]


def test_cp2_dp2_padded_and_packed_rows_are_invariant_and_equal_cp1(dp2_whole, tmp_path):
    iters = ["--train-iters", "2"]
    logs = train(tmp_path, 4, [("upstream", CP + iters),
                               ("balanced", CP + iters + BALANCED + ["--orch-microbatching", "equal_count"]),
                               ("packed", CP + iters + BALANCED + ["--orch-microbatching", "packed"])], timeout_s=480)
    assert all(logs[name]["layout"] == (False, 2) for name in logs)
    calls = {name: logs[name]["cp_attention_calls"] for name in logs}  # the CPU path, THD for packed rows
    assert calls["upstream"]["padded"] > 0 and calls["balanced"]["padded"] > 0 and calls["packed"]["packed"] > 0, calls
    assert calls["upstream"]["packed"] == calls["balanced"]["packed"] == calls["packed"]["padded"] == 0, calls
    for name in ("balanced", "packed"):
        assert_same_run(logs[name], logs["upstream"], 2, f"CP 2 x DP 2, post-balancing on ({name}) / off")
        assert_plan_balances(logs[name])
    assert_same_run(logs["upstream"], dp2_whole, 2, "CP 2 / CP 1 at DP 2")  # the CP shards are exact


def test_tp2_sequence_parallel_cp2_dp2_is_invariant(tmp_path):
    """Eight ranks, one step (the heavy one): sequence and context parallelism together; also with the encoders at
    TP 1 on every rank (``all``, its first step checked): each CP rank's encoder group (DP 2 x 2 encoder replicas)
    encodes every item, as every CP rank of a replica does upstream, and the encoder gradients are summed over the
    replicas, then by DDP over DP x CP."""
    iters = ["--train-iters", "1"]
    logs = train(tmp_path, 8, [("upstream", SP + CP + iters), ("balanced", SP + CP + iters + BALANCED),
                               ("encoder_tp1", SP + CP + iters + BALANCED + [
                                   "--orch-encoder-ranks", "all", "--orch-encoder-tensor-parallel-size", "1",
                                   "--orch-verify-first-step"])],
                 timeout_s=600)
    assert logs["upstream"]["layout"] == logs["balanced"]["layout"] == logs["encoder_tp1"]["layout"] == (True, 2)
    assert_same_run(logs["balanced"], logs["upstream"], 1, "TP 2 + SP x CP 2 x DP 2, post-balancing on / off")
    assert_plan_balances(logs["balanced"])
    assert_first_step_checked(logs, "encoder_tp1")
    assert_same_encoder_tp1_run(logs["encoder_tp1"], logs["upstream"], 1,
                                "TP 2 + SP x CP 2 x DP 2, encoders at TP 1 / upstream")
    assert_plan_balances(logs["encoder_tp1"])
    heavy = logs["encoder_tp1"]["items_encoded"][0]
    assert len(heavy["vision"]) == 8 and min(heavy["vision"]) > 0, heavy
    print("encoder_tp1 heavy step items per rank:", heavy)


def test_pp2_dp2_encoders_on_every_stage_is_invariant(tmp_path):
    """PP 2 x DP 2, the encoders on the first stage (Megatron's layout, post-balancing off) against the encoders on
    every stage (on, ``all``, its first step checked against the loader's layout): every rank encodes, the check
    passes, the losses and parameters agree, and the second stage's encoders train to the first stage's
    parameters. The same with Megatron DDP's overlapped reduction (``--overlap-grad-reduce``, small buckets: the
    first stage's gradients in many), all-reduced and, with Adam (its lower learning rate keeps Adam's per-element
    rescaling of rounding noise under the tolerance), reduce-scattered (``--use-distributed-optimizer``, gradient
    norms compared too: Adam would hide a gradient off by a factor). From their second step on (DDP calibrates on the
    first step's balanced run) a bucket's reduction starts when its last gradient reports ready, which the encoders'
    must do only once summed over the stages; the third step has no vision items at all (every vision encoder
    reports zeros)."""
    flags = ["--pipeline-model-parallel-size", "2", "--train-iters", "3"]
    adam = ["--optimizer", "adam", "--lr", "1e-3"]
    all_ranks = BALANCED + ["--orch-encoder-ranks", "all", "--orch-verify-first-step"]
    overlap = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
    logs = train(tmp_path, 4, [("upstream", flags), ("all", flags + all_ranks), ("overlap", flags + all_ranks + overlap),
                               ("upstream_adam", flags + adam),
                               ("overlap_distopt", flags + adam + all_ranks + overlap + ["--use-distributed-optimizer"])],
                 timeout_s=600)
    assert_first_step_checked(logs)
    assert_same_run(logs["all"], logs["upstream"], 3, "PP 2 x DP 2, encoders on every stage / upstream")
    for run, upstream, distributed_optimizer in (("overlap", "upstream", False),
                                                 ("overlap_distopt", "upstream_adam", True)):
        assert_first_step_checked(logs, run)
        (overlapped, distributed, buckets), = logs[run]["ddp_of_rank"](0)  # stage 0 (stage 1: one bucket)
        assert overlapped and distributed == distributed_optimizer and buckets > 10, logs[run]["ddp_of_rank"](0)
        assert_same_run(logs[run], logs[upstream], 3, f"PP 2 x DP 2, encoders on every stage, {run} / {upstream}")
        for iteration, norm in logs[upstream]["grad_norms"].items():
            assert logs[run]["grad_norms"][iteration] == pytest.approx(norm, rel=TOLERANCE), (logs[run]["grad_norms"],
                                                                                             logs[upstream]["grad_norms"])
    assert_plan_balances(logs["all"])
    heavy = logs["all"]["items_encoded"][0]  # every vision item on DP rank 0 as loaded
    assert len(heavy["vision"]) == 4 and min(heavy["vision"]) > 0, heavy
    assert max(heavy["vision"]) - min(heavy["vision"]) <= 1, heavy
    assert logs["upstream"]["items_encoded"] == [None] * 3
    for run in ("all", "overlap", "overlap_distopt"):
        stage_1 = logs[run]["params_of_rank"](2)  # stage 1 of DP rank 0 (ranks stage * DP + dp)
        encoders = {name: value for name, value in logs[run]["params"].items() if name.startswith("encoders.")}
        assert encoders and all(name in stage_1 for name in encoders)
        for name, value in encoders.items():
            torch.testing.assert_close(stage_1[name], value, rtol=0, atol=0, msg=lambda m: f"{run}, stage 1 {name}: {m}")


def test_tp2_pp2_dp2_encoders_at_tensor_parallel_1_on_every_rank_is_invariant(tmp_path):
    """Eight ranks, one step (the heavy one): TP 2 x PP 2 x DP 2, the encoders at TP 2 on the first stage (Megatron's
    layout, post-balancing off) against the encoders at TP 1 on every rank (``all``, encoder TP 1: 8 encoder
    replicas, each TP rank of the backbone receiving every embedding its replica needs), its moves node-wise (4
    nodes of 2 ranks: every encoder-group move as two hops over the group's nodes, the copies included): losses,
    parameters and gradient norms agree (:func:`assert_same_encoder_tp1_run`)."""
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "1"]
    logs = train(tmp_path, 8, [("upstream", flags),
                               ("all", flags + BALANCED + ["--orch-encoder-ranks", "all", "--orch-verify-first-step",
                                                           "--orch-encoder-tensor-parallel-size", "1",
                                                           "--orch-all-to-all", "node-wise"])],
                 timeout_s=600)
    assert_first_step_checked(logs)
    assert_same_encoder_tp1_run(logs["all"], logs["upstream"], 1,
                                "TP 2 x PP 2 x DP 2, encoders at TP 1 on every rank / upstream")
    assert_plan_balances(logs["all"])
    heavy = logs["all"]["items_encoded"][0]
    assert len(heavy["vision"]) == 8 and max(heavy["vision"]) - min(heavy["vision"]) <= 1, heavy
    assert min(heavy["vision"]) > 0, heavy


def test_pp2_vpp2_dp2_encoders_in_every_ranks_first_chunk_is_invariant(tmp_path):
    """PP 2 x VPP 2 x DP 2 (two model chunks per pipeline rank, megatron-core's interleaved 1F1B), one step (the
    heavy one): the encoders in the first stage's first chunk (upstream) against the encoders in every rank's first
    chunk (``all``): the losses and both chunks' parameters agree, every rank encodes, and the second stage's
    first chunk holds the encoders (its second none)."""
    flags = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
             "1", "--train-iters", "1"]
    logs = train(tmp_path, 4, [("upstream", flags), ("all", flags + BALANCED + ["--orch-encoder-ranks", "all",
                                                                                "--orch-verify-first-step"])],
                 timeout_s=420)
    assert_first_step_checked(logs)
    assert any(name.startswith("chunk1.") for name in logs["all"]["params"])
    assert_same_run(logs["all"], logs["upstream"], 1, "PP 2 x VPP 2 x DP 2, encoders on every rank / upstream")
    assert_plan_balances(logs["all"])
    heavy = logs["all"]["items_encoded"][0]
    assert len(heavy["vision"]) == 4 and min(heavy["vision"]) > 0 and max(heavy["vision"]) - min(heavy["vision"]) <= 1
    stage_1 = logs["all"]["params_of_rank"](2)  # stage 1 of DP rank 0 (ranks stage * DP + dp)
    encoders = {name: value for name, value in logs["all"]["params"].items() if name.startswith("encoders.")}
    assert encoders and not any(name.startswith("chunk1.encoders.") for name in stage_1)
    for name, value in encoders.items():
        torch.testing.assert_close(stage_1[name], value, rtol=0, atol=0, msg=lambda m: f"stage 1 {name}: {m}")
