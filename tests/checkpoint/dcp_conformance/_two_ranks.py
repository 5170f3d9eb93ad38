"""What each of two ranks does for the multi-rank conformance tests (one process group, many
behaviours, so that each storage layer costs one start of two ranks). Returns, per behaviour,
plain values the tests compare."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def _value(t: torch.Tensor) -> list[Any]:
    return t.tolist()  # type: ignore[no-any-return]


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _fsdp(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _mlp(seed)
    mesh = init_device_mesh("cpu", (world,))
    for part in (model[0], model[2]):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    loss = model(torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def run(root: str, layer_name: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    from tests.checkpoint.dcp_conformance._layers import Layer

    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    try:
        with Layer(layer_name) as layer:
            writer = layer.writer(f"{root}/unused")  # one writer for every save, as a job keeps
            # replicated plain tensors and values: every rank saves the same, each loads it
            state = {"w": torch.arange(12.0).reshape(3, 4), "n": 5}
            dcp.save(state, checkpoint_id=f"{root}/rep", storage_writer=writer)
            back = {"w": torch.zeros(3, 4), "n": 0}
            dcp.load(back, storage_reader=layer.reader(f"{root}/rep"))
            out["replicated"] = (_value(back["w"]), back["n"])
            metadata = layer.reader(f"{root}/rep").read_metadata()
            out["replicated_chunks"] = len(metadata.state_dict_metadata["w"].chunks)

            # keys only one rank has: each rank loads both
            dcp.save(
                {f"r{rank}": torch.full((2,), float(rank))},
                checkpoint_id=f"{root}/own",
                storage_writer=writer,
            )
            both = {f"r{r}": torch.zeros(2) for r in range(world)}
            dcp.load(both, storage_reader=layer.reader(f"{root}/own"))
            out["own_keys"] = {k: _value(v) for k, v in both.items()}

            # a DTensor sharded by rows, loaded into other shardings (resharding)
            mesh = init_device_mesh("cpu", (world,))
            full = torch.arange(70.0).reshape(7, 10)  # 7 rows: uneven shards
            dcp.save(
                {"d": distribute_tensor(full, mesh, [Shard(0)])},
                checkpoint_id=f"{root}/dt",
                storage_writer=writer,
            )
            for name, placement in (("rows", Shard(0)), ("cols", Shard(1)), ("rep", Replicate())):
                target = distribute_tensor(torch.zeros(7, 10), mesh, [placement])
                dcp.load({"d": target}, storage_reader=layer.reader(f"{root}/dt"))
                out[f"reshard_{name}"] = bool(torch.equal(target.full_tensor(), full))
            plain = {"d": torch.zeros(7, 10)}  # a sharded save into a plain tensor
            dcp.load(plain, storage_reader=layer.reader(f"{root}/dt"))
            out["sharded_to_plain"] = bool(torch.equal(plain["d"], full))
            # a plain save into a sharded target
            target = distribute_tensor(torch.zeros(3, 4), mesh, [Shard(1)])
            dcp.load({"w": target}, storage_reader=layer.reader(f"{root}/rep"))
            out["plain_to_sharded"] = bool(torch.equal(target.full_tensor(), state["w"]))

            # DDP model and optimizer through torch's state_dict API
            model = DistributedDataParallel(_mlp(1))
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).sum().backward()
            opt.step()
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=f"{root}/ddp",
                storage_writer=writer,
            )
            model2 = DistributedDataParallel(_mlp(2))
            opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
            model2(torch.ones(1, 5)).sum().backward()
            opt2.step()
            model_sd2, optim_sd2 = get_state_dict(model2, opt2)
            loaded = {"model": model_sd2, "optim": optim_sd2}
            dcp.load(loaded, storage_reader=layer.reader(f"{root}/ddp"))
            set_state_dict(
                model2, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
            )
            out["ddp_params"] = all(
                torch.equal(a, b)
                for a, b in zip(model.parameters(), model2.parameters(), strict=True)
            )
            s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
            out["ddp_optim"] = set(s1) == set(s2) and all(
                torch.equal(s1[k][n], s2[k][n]) for k in s1 for n in ("exp_avg", "exp_avg_sq")
            )

            # async_save from both ranks, then an overwrite of the same id
            for step in (1.0, 2.0):
                t = {"t": torch.full((4,), step + rank * 10)}
                dcp.async_save(
                    {f"t{rank}": t["t"]}, checkpoint_id=f"{root}/async", storage_writer=writer
                ).result()
                t["t"].fill_(-1.0)
                back2 = {f"t{r}": torch.zeros(4) for r in range(world)}
                dcp.load(back2, storage_reader=layer.reader(f"{root}/async"))
                out[f"async_{step:g}"] = {k: _value(v) for k, v in back2.items()}

            # an overwrite by a sync save, and overwrite=False refused on every rank
            dcp.save(
                {"t": torch.full((2,), 7.0)}, checkpoint_id=f"{root}/rep", storage_writer=writer
            )
            back3 = {"t": torch.zeros(2)}
            dcp.load(back3, storage_reader=layer.reader(f"{root}/rep"))
            out["overwritten"] = _value(back3["t"])
            try:
                dcp.save(
                    {"t": torch.zeros(2)},
                    storage_writer=layer.writer(f"{root}/rep", overwrite=False),
                )
                out["refused"] = False
            except BaseException as exc:
                out["refused"] = "already" in str(exc)

            # an FSDP2 model and optimizer: save, load into a fresh one, train on identically
            model3, opt3 = _fsdp(1, world)
            _step(model3, opt3, 0)
            msd, osd = get_state_dict(model3, opt3)
            dcp.save(
                {"model": msd, "optim": osd}, checkpoint_id=f"{root}/fsdp", storage_writer=writer
            )
            model4, opt4 = _fsdp(2, world)
            _step(model4, opt4, 5)
            msd4, osd4 = get_state_dict(model4, opt4)
            fsdp_state = {"model": msd4, "optim": osd4}
            dcp.load(fsdp_state, storage_reader=layer.reader(f"{root}/fsdp"))
            set_state_dict(
                model4,
                opt4,
                model_state_dict=fsdp_state["model"],
                optim_state_dict=fsdp_state["optim"],
            )
            out["fsdp_next_loss"] = (_step(model3, opt3, 1), _step(model4, opt4, 1))
            out["fsdp_params"] = all(
                torch.equal(a.full_tensor(), b.full_tensor())
                for a, b in zip(model3.parameters(), model4.parameters(), strict=True)
            )

            # ranks that build their state dicts in different key orders
            items = [("k1", torch.ones(2)), ("k2", torch.full((3,), 2.0)), ("k3", 3)]
            ordered = dict(items if rank == 0 else reversed(items))
            dcp.save(ordered, checkpoint_id=f"{root}/order", storage_writer=writer)
            back5 = {"k3": 0, "k2": torch.zeros(3), "k1": torch.zeros(2)}
            dcp.load(back5, storage_reader=layer.reader(f"{root}/order"))
            out["key_order"] = {k: v if isinstance(v, int) else _value(v) for k, v in back5.items()}

            # a save and a load on a process group of their own (as async_save users do on gloo)
            group = dist.new_group(backend="gloo")
            dcp.save(
                {"g": torch.full((2,), 4.0)},
                checkpoint_id=f"{root}/group",
                storage_writer=writer,
                process_group=group,
            )
            back6 = {"g": torch.zeros(2)}
            dcp.load(back6, storage_reader=layer.reader(f"{root}/group"), process_group=group)
            out["own_group"] = _value(back6["g"])

            # async_save on its own group, a planner that saves replicas from the lowest rank,
            # and a DTensor with fewer rows than ranks (an empty local shard)
            dcp.async_save(
                {"a": torch.full((2,), 6.0)},
                checkpoint_id=f"{root}/agroup",
                storage_writer=writer,
                process_group=group,
            ).result()
            back7 = {"a": torch.zeros(2)}
            dcp.load(back7, storage_reader=layer.reader(f"{root}/agroup"))
            out["async_own_group"] = _value(back7["a"])
            from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

            dcp.save(
                {"low": torch.arange(5.0)},
                checkpoint_id=f"{root}/low",
                storage_writer=writer,
                planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
            )
            back8 = {"low": torch.zeros(5)}
            dcp.load(back8, storage_reader=layer.reader(f"{root}/low"))
            out["lowest_rank"] = _value(back8["low"])
            thin = torch.arange(3.0).reshape(1, 3)
            dcp.save(
                {"thin": distribute_tensor(thin, mesh, [Shard(0)])},
                checkpoint_id=f"{root}/thin",
                storage_writer=writer,
            )
            target9 = distribute_tensor(torch.zeros(1, 3), mesh, [Shard(1)])
            dcp.load({"thin": target9}, storage_reader=layer.reader(f"{root}/thin"))
            out["empty_shard"] = bool(torch.equal(target9.full_tensor(), thin))

            # a planner that caches its plans, saving again and again to one id
            cached = []
            for step in (1.0, 2.0, 3.0):
                state = {"c": torch.full((3,), step), f"own{rank}": torch.full((2,), step + rank)}
                dcp.save(
                    state,
                    checkpoint_id=f"{root}/cached",
                    storage_writer=writer,
                    planner=DefaultSavePlanner(enable_plan_caching=True),
                )
                back4 = {"c": torch.zeros(3), **{f"own{r}": torch.zeros(2) for r in range(world)}}
                dcp.load(back4, storage_reader=layer.reader(f"{root}/cached"))
                cached.append({k: _value(v) for k, v in back4.items()})
            out["cached_plans"] = cached
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return out
