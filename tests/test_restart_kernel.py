"""A real kernel restart (`jupyter_client`, `km.restart_kernel`): the re-run cells load every program from
the program store (no trace, no XLA) and train to the same losses, and a checkpoint saved just before the
restart (committed by the kernel's exit) resumes after it to the uninterrupted run's parameters.

Cost: one kernel, started twice (about 10-20 s with the compiles). The cell files of a kernel are
`.../ipykernel_PID/HASH.py`: the PID changes at a restart, the cells' content does not.
"""

import json
import os
import textwrap

import pytest
from _cells import TINY_EXPERIMENT
from test_kernel import ROOT, Kernel, kernel_manager

TRAIN = textwrap.dedent(
    """
    import json as _json
    n = Nitro(Tiny(), data=data, batch_size=16, progress=False, seed=5)
    rows = n.train(2)
    straight = {"losses": [r["loss"] for r in rows], "valid": [r["valid_loss"] for r in rows],
                "params": jax.tree.map(lambda a: np.asarray(a).tolist(), n.params), "step": n.step}
    """
)

# An epoch, a checkpoint, and (in the test) the restart right after: the write is still in the background.
HALF = textwrap.dedent(
    """
    half = Nitro(Tiny(), data=data, batch_size=16, progress=False, seed=5)
    half.train(1)
    saved = half.save(CKPT)
    """
)

RESUME = textwrap.dedent(
    """
    resumed = Nitro(Tiny(), data=data, batch_size=16, progress=False, seed=5, resume=CKPT)
    at = (resumed.step, resumed.epoch)
    resumed.train(1)
    after = {"losses": [r["loss"] for r in resumed.history], "valid": [r["valid_loss"] for r in resumed.history],
             "params": jax.tree.map(lambda a: np.asarray(a).tolist(), resumed.params), "step": resumed.step}
    """
)


def _texts(messages) -> list[str]:
    """Every text the cell shows at its end: streams and the text/plain of displays (the compile lines are
    displays), each display in its final form (an `update_display_data` replaces the display it names)."""
    shown = []  # texts, and [display_id, text] slots that updates fill in place
    slots = {}
    for m in messages:
        c = m["content"]
        if m["msg_type"] == "stream":
            shown.append(c["text"])
        elif m["msg_type"] in ("display_data", "execute_result"):
            slot = [c["data"].get("text/plain", "")]
            shown.append(slot)
            display_id = c.get("transient", {}).get("display_id")
            if display_id is not None:
                slots[display_id] = slot
        elif m["msg_type"] == "update_display_data":
            slot = slots.get(c.get("transient", {}).get("display_id"))
            if slot is not None:
                slot[0] = c["data"].get("text/plain", "")
    return [line for item in shown for line in (item if isinstance(item, str) else item[0]).splitlines()]


def _compiles(messages) -> list[tuple[str, bool]]:
    return [(t.split()[2], " from disk " in t) for t in _texts(messages) if t.startswith("nitro_ipy: compiled ")]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """Session 1 trains (and checkpoints), the kernel restarts, session 2 re-runs the same cells."""
    root = tmp_path_factory.mktemp("restart")
    store, ckpt = root / "store", str(root / "half.nitro.npz")
    os.makedirs(store, mode=0o700)
    env = {**os.environ, "NITRO_IPY_CACHE_DIR": str(store)}
    setup = TINY_EXPERIMENT + f"\nCKPT = {ckpt!r}\n"
    out = {}
    with kernel_manager() as km:
        km.start_kernel(cwd=str(ROOT), env=env)
        client = km.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=120)
            k = Kernel(client)
            k.run("%load_ext nitro_ipy")
            k.run(setup)
            out["first"] = _compiles(k.run(TRAIN, timeout=300))
            out["straight"] = k.value("straight")
            out["pid"] = k.value("__import__('os').getpid()")
            k.run(HALF)
            km.restart_kernel()  # a graceful restart: the kernel process exits, a new one starts
            client.wait_for_ready(timeout=120)
            out["new_pid"] = k.value("__import__('os').getpid()")
            k.run("%load_ext nitro_ipy")
            k.run(setup)
            out["second"] = _compiles(k.run(TRAIN, timeout=300))
            out["again"] = k.value("straight")
            out["stats"] = k.value("list(nitro_ipy.cache_stats())[:3]")
            out["resume"] = _compiles(k.run(RESUME, timeout=300))
            out["at"] = k.value("at")
            out["after"] = k.value("after")
        finally:
            client.stop_channels()
            km.shutdown_kernel(now=True)
    return out


def test_after_a_kernel_restart_every_program_loads_from_disk_and_trains_the_same(restarted):
    assert restarted["new_pid"] != restarted["pid"]  # a new process
    assert restarted["first"] == [("grad", False), ("opt", False), ("eval", False)]
    assert restarted["second"] == [("grad", True), ("opt", True), ("eval", True)]  # no trace, no XLA
    assert restarted["again"] == restarted["straight"]  # the same losses and parameters, exactly
    hits, misses, entries = restarted["stats"]
    assert misses == entries == 3  # a load is a miss that creates an entry


def test_a_checkpoint_saved_just_before_the_restart_resumes_to_the_uninterrupted_run(restarted):
    assert restarted["at"] == [3, 1]  # committed by the exiting kernel: 48 examples, 3 steps an epoch
    assert restarted["resume"] == []  # the programs are the ones this kernel already has
    after, straight = restarted["after"], restarted["straight"]
    assert after["params"] == straight["params"] and after["step"] == straight["step"] == 6
    assert after["losses"] == straight["losses"] and after["valid"] == straight["valid"]
    assert json.dumps(after, sort_keys=True) == json.dumps(straight, sort_keys=True)
