"""The stand-in device itself: it refuses what CUDA refuses (an op mixing its tensors with CPU ones, naming the
op), allows what CUDA allows (0-dim CPU operands, CPU index tensors, copies), gives stand-in tensors from
factories with `device=` and CPU tensors from factories without, moves modules with their ties, runs autograd and
an optimizer step with the CPU's values, and counts host reads."""

import copy

import pytest
import torch
import torch.nn.functional as F

from rlhfuse.testing.standin import DeviceMixError, StandinTensor, recording, standin_device

DEVICE = standin_device()


def test_an_op_mixing_standin_and_cpu_tensors_raises_naming_the_op() -> None:
    x_B = torch.ones(3, device=DEVICE)
    with pytest.raises(DeviceMixError, match=r"aten\.add\.Tensor mixes standin:0 and cpu .*'other'"):
        x_B + torch.ones(3)
    with pytest.raises(DeviceMixError, match=r"aten\.isin"):
        torch.isin(x_B, torch.tensor([1.0]))  # a 1-element CPU tensor is not a scalar
    with pytest.raises(DeviceMixError, match=r"aten\.cat"):
        torch.cat([x_B, torch.zeros(2)])
    # a factory without device= makes a CPU tensor, which fails on its first mix, as on a GPU
    embed = torch.nn.Embedding(10, 4).to(DEVICE)
    with pytest.raises(DeviceMixError, match=r"aten\.embedding\.default .*'indices'"):
        embed(torch.zeros(2, dtype=torch.long))
    # writing device values into a CPU tensor: CUDA's index_put_ refuses it too
    with pytest.raises(DeviceMixError, match=r"aten\.index_put_\.default .*'self'"):
        torch.zeros(3)[torch.tensor([0, 1])] = x_B[:2]


def test_the_standin_is_named_never_detected() -> None:
    """Registered (DEVICE above), the stand-in is still not an accelerator a library finds on its own: with torch's
    default hooks `torch.accelerator.is_available()` turned true for the rest of the process, and peft 0.22's
    `infer_device` loaded adapters onto the stand-in in whichever test of the worker ran next."""
    assert torch.accelerator.is_available() is False
    assert torch.ones(1, device=DEVICE).device == DEVICE  # naming it still works
    peft_other = pytest.importorskip("peft.utils.other")
    assert peft_other.infer_device() == "cpu"


def test_what_cuda_allows_is_allowed() -> None:
    x_B = torch.arange(4.0, device=DEVICE)
    assert torch.equal((x_B * torch.tensor(2.0)).cpu(), torch.arange(4.0) * 2)  # 0-dim CPU operand
    assert torch.equal(x_B[torch.tensor([3, 0])].cpu(), torch.tensor([3.0, 0.0]))  # CPU index
    x_B[torch.tensor([1])] = torch.tensor(7.0)
    assert x_B.tolist() == [0.0, 7.0, 2.0, 3.0]
    host_B = torch.zeros(4)
    host_B.copy_(x_B)  # copies across devices
    assert type(host_B) is torch.Tensor and host_B.tolist() == [0.0, 7.0, 2.0, 3.0]
    back = x_B.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    with pytest.raises(DeviceMixError):  # a 0-dim CPU tensor cannot be the one an in-place op writes
        torch.tensor(0.0).add_(x_B[0])


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.arange(5, device=d),
        lambda d: torch.arange(1, 9, 3, device=d),
        lambda d: torch.eye(3, device=d),
        lambda d: torch.zeros(2, 3, device=d),
        lambda d: torch.full((2,), 7, device=d),
        lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
        lambda d: torch.as_tensor([1.5, 2.5], device=d),
        lambda d: torch.linspace(0, 1, 4, device=d),
        lambda d: torch.tril_indices(3, 3, device=d),
    ],
)
def test_factories_with_device_give_standin_tensors_of_the_right_shape(make) -> None:
    out, expected = make(DEVICE), make("cpu")
    assert isinstance(out, StandinTensor) and out.device == DEVICE
    assert out.shape == expected.shape and out.stride() == expected.stride()
    assert torch.equal(out.cpu(), expected)
    assert type(make(None)) is torch.Tensor  # no device: the CPU


def test_random_factories_and_sampling_follow_the_cpu_generator() -> None:
    torch.manual_seed(3)
    on_cpu = (torch.randn(4), torch.multinomial(torch.ones(6), 3))
    torch.manual_seed(3)
    on_standin = (torch.randn(4, device=DEVICE), torch.multinomial(torch.ones(6, device=DEVICE), 3))
    for a, b in zip(on_cpu, on_standin, strict=True):
        assert b.device == DEVICE and torch.equal(a, b.cpu())


def _tied_lm(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11, bias=False))
    model[1].weight = model[0].weight
    return model


def test_module_to_keeps_ties_and_training_matches_the_cpu() -> None:
    ids_BT = torch.tensor([[1, 2, 3], [4, 5, 6]])
    losses, weights = [], []
    for device in ("cpu", DEVICE):
        model = _tied_lm(0).to(device)
        assert model[1].weight is model[0].weight and isinstance(model[0].weight, torch.nn.Parameter)
        assert {p.device for p in model.parameters()} == {torch.device(device)}
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)  # foreach kernels on the stand-in
        for _ in range(2):
            logits_BTV = model(ids_BT.to(device))
            loss = F.cross_entropy(logits_BTV.flatten(0, 1), ids_BT.to(device).flatten())
            loss.backward()  # autograd runs on the stand-in's device thread
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        losses.append(float(loss.detach()))
        weights.append(model[0].weight.detach().cpu())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    torch.testing.assert_close(weights[0], weights[1])


def test_deepcopy_and_state_dict_stay_on_the_standin() -> None:
    model = _tied_lm(1).to(DEVICE)
    twin = copy.deepcopy(model)
    assert twin[1].weight is twin[0].weight and twin[0].weight.device == DEVICE
    assert isinstance(twin[0].weight, torch.nn.Parameter)
    twin.load_state_dict({k: v.cpu() * 0 for k, v in model.state_dict().items()})  # a host state dict loads
    assert twin[0].weight.device == DEVICE and float(twin[0].weight.detach().abs().sum()) == 0.0


def test_saved_tensors_load_on_the_host_and_storages_count_ties_once(tmp_path) -> None:
    from rlhfuse.models.stages import resident_bytes

    model = _tied_lm(2)
    host_bytes = resident_bytes(model)
    model.to(DEVICE)
    assert resident_bytes(model) == host_bytes == 11 * 8 * 4  # the tied weight once
    torch.save(model.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=True)  # as a CUDA checkpoint
    assert all(type(t) is torch.Tensor for t in state.values())
    assert torch.equal(state["0.weight"], model[0].weight.detach().cpu())


def test_recording_counts_host_reads_and_record_stream() -> None:
    x_B = torch.arange(3, device=DEVICE)
    with recording() as rec:
        x_B.sum().item()
        x_B.tolist()
        bool(x_B.max() > 1)
        x_B.cpu()
        (x_B + 1).sum()  # device work only: no read
        x_B.record_stream(torch.accelerator.current_stream(DEVICE))
    assert (rec.host_reads, rec.record_streams) == (4, 1)


def _collectives_on_gloo(rank: int, init_file: str) -> None:
    import datetime

    import torch.distributed as dist

    from rlhfuse import distributed
    from rlhfuse.testing.processes import leave_after_success

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    device = standin_device()
    total_B = torch.full((3,), float(rank + 1), device=device)
    distributed.all_reduce(total_B)
    gathered = distributed.all_gather(torch.full((2,), float(rank), device=device))
    received_B = torch.zeros(3, device=device)
    if rank == 0:
        distributed.isend(torch.arange(3.0, device=device), 1).wait()
    else:
        distributed.irecv(received_B, 0).wait()
    assert isinstance(total_B, StandinTensor) and total_B.tolist() == [3.0, 3.0, 3.0]
    assert all(t.device == device for t in gathered) and [t.tolist() for t in gathered] == [
        [0.0] * 2,
        [1.0] * 2,
    ]
    assert received_B.tolist() == ([0.0, 0.0, 0.0] if rank == 0 else [0.0, 1.0, 2.0])
    leave_after_success()


@pytest.mark.distributed
def test_gloo_collectives_and_point_to_point_carry_standin_tensors(tmp_path) -> None:
    """c10d's ops go through the dispatcher, so gloo runs on the stand-in tensors' CPU data: the multi-process
    paths can run on the stand-in device over gloo (with device tensors where NCCL would need them)."""
    import torch.multiprocessing as mp

    mp.start_processes(_collectives_on_gloo, args=(str(tmp_path / "init"),), nprocs=2, start_method="spawn")
