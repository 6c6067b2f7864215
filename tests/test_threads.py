"""train.threads=auto: the thread count follows the cores other processes leave the run, and only where it pays."""

from __future__ import annotations

import pytest

from sdtrain.train.threads import ThreadTuner

# Seconds a step takes by (threads, cores other processes hold of two), as measured on the shapes demo's UNet.
PACE = {(2, 0): 0.43, (1, 0): 0.78, (2, 1): 1.56, (1, 1): 0.76}


class Machine:
    """Two cores, a run whose steps take PACE's seconds, and `others` cores held by other processes."""

    def __init__(self, pace=PACE):
        self.pace, self.others, self.threads = pace, 0, 2
        self.now = self.busy = self.ours = 0.0
        self.tuner = ThreadTuner(most=2, cpus={0, 1}, read_busy=lambda cpus: self.busy,
                                 read_tree=lambda: {1: self.ours}, clock=lambda: self.now, set_threads=self._set)
        self.step = 0
        self.tuner.restart(0)

    def _set(self, threads: int) -> None:
        self.threads = threads

    def window(self, steps: int = 20) -> None:
        seconds = steps * self.pace[(self.threads, self.others)]
        ours = self.threads * min(1.0, 2 / (self.threads + self.others))
        self.now += seconds
        self.busy += seconds * (ours + self.others)
        self.ours += seconds * ours
        self.step += steps
        self.tuner.observe(self.step)


def test_an_idle_machine_keeps_every_thread_and_probes_nothing():
    machine = Machine()
    counts = []
    for _ in range(30):
        machine.window()
        counts.append(machine.threads)
    assert counts == [2] * 30


def test_another_process_on_a_core_moves_the_run_to_one_thread_and_back_when_it_ends():
    machine = Machine()
    machine.window()
    machine.others = 1
    machine.window()  # the busy window: it shows the other process
    machine.window()  # the probe at one thread
    assert machine.threads == 1
    for _ in range(5):
        machine.window()
    assert machine.threads == 1
    machine.others = 0
    machine.window()  # shows the freed core
    machine.window()  # the probe at two
    assert machine.threads == 2
    for _ in range(5):
        machine.window()
    assert machine.threads == 2


def test_a_probe_that_is_not_faster_is_undone_and_retried_ever_less_often():
    # Another process holds a core, yet one thread is no faster: every probe loses.
    machine = Machine(pace={**PACE, (1, 1): 1.56})
    machine.others = 1
    history = []
    for _ in range(40):
        machine.window()
        history.append(machine.threads)
    # Each probe lasts one window and is undone: 5 of 40 windows ran at the losing count.
    assert history.count(1) == 5 and all(history[i + 1] == 2 for i, t in enumerate(history[:-1]) if t == 1)
    probes = [i for i, threads in enumerate(history) if threads == 1]
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_a_run_on_threads_auto_judges_its_training_windows_and_gives_its_threads_back(tmp_path, shapes_dir,
                                                                                       monkeypatch):
    import torch

    from sdtrain.train import threads

    from .conftest import train

    seen = []
    observe, restart = threads.ThreadTuner.observe, threads.ThreadTuner.restart
    monkeypatch.setattr(threads.ThreadTuner, "observe", lambda self, step: (seen.append(("observe", step)),
                                                                              observe(self, step)))
    monkeypatch.setattr(threads.ThreadTuner, "restart", lambda self, step: (seen.append(("restart", step)),
                                                                              restart(self, step)))
    before = torch.get_num_threads()
    train("autoencoder.yaml", tmp_path / "run", f"data.shards={shapes_dir}", "train.max_steps=6", "logging.every=2",
          "checkpoint.every=4", "train.threads=auto")
    # Windows start with training and after each save; each logging point ends one.
    assert [call for call in seen if call[0] == "observe"] == [("observe", 2), ("observe", 4), ("observe", 6)]
    assert ("restart", 0) in seen and ("restart", 4) in seen
    assert torch.get_num_threads() == before


def test_a_bad_thread_count_is_one_line(tmp_path):
    from sdtrain.config import load_config
    from sdtrain.errors import UserError

    with pytest.raises(UserError, match="train.threads: must be a thread count, 0 .torch's default. or auto"):
        load_config(None, ["stage=diffusion", f"run_dir={tmp_path}", f"data.shards={tmp_path}", "train.threads=fast"])


def test_the_cores_other_processes_used_leave_the_next_command_its_threads():
    from sdtrain.train.threads import Usage, threads_left

    # 10 s in which the machine's two cores were busy 19 s and this process and its loader worker 9.5 of them.
    before, after = Usage(0.0, 100.0, {1: 5.0, 2: 1.0}), Usage(10.0, 119.0, {1: 13.0, 2: 2.5})
    others = before.others_until(after)
    assert others == pytest.approx(0.95)
    assert threads_left(2, others, most=2) == 1
    assert threads_left(2, 0.1, most=2) == 2
    assert threads_left(8, 7.9, most=8) == 1  # never none
