"""The harness's own tests (run by exercises/tests/gpu_check.rs under $TORCH_PYTHON): every
comparison a GPU row rests on fails when its two sides differ, a merged or resumed table keeps
each row's provenance, the tiers fit their time, the NCCL rows fall back to MPI when NCCL
refuses, and the one writer (gpucheck/output.py) never writes through a link or over what is not
a regular file. No binaries run here: the runs are made up."""
import contextlib
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import types
import unittest
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpucheck import course, docs, harness, machine, multirank, output, table, tiers, timings  # noqa: E402
from gpucheck.harness import CheckFailed, Harness  # noqa: E402


def write_safetensors(path, tensors):
    """A .safetensors file of float32 `tensors` (the format our checkpoints use)."""
    header, body, offset = {}, b"", 0
    for name, t in tensors.items():
        data = t.contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        body += data
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)


def fake_args(**kw):
    args = dict(bin="/nowhere", python=sys.executable, budget=480, no_timings=False, results=tempfile.mkdtemp())
    args.update(kw)
    return types.SimpleNamespace(**args)


def fake_harness(device="cuda", gpus=1, committed=None):
    return Harness(fake_args(), device, gpus, "NVIDIA Test GPU", "abc1234", None, committed)


class Runs:
    """Made-up runs: a results JSON and a whole-model checkpoint in a folder each."""

    def __init__(self):
        self.dir = tempfile.mkdtemp()

    def make(self, key, steps=4, losses=(2.5,), params=None):
        folder = os.path.join(self.dir, key)
        os.makedirs(folder)
        params = params or {"w": torch.ones(3, 2), "b": torch.zeros(2)}
        write_safetensors(os.path.join(folder, "run.safetensors"), params)
        write_safetensors(os.path.join(folder, "run.previous.safetensors"), {k: v * 0 for k, v in params.items()})  # an older one, left beside it
        history = [{"train_loss": x} for x in losses]
        return {"json": {"steps": steps, "history": history, "step_losses": list(losses)}, "dir": folder, "stdout": "", "stderr": ""}


class Comparisons(unittest.TestCase):
    def setUp(self):
        self.h = fake_harness()
        self.runs = Runs()
        self.base = {"w": torch.linspace(-1, 1, 6).reshape(3, 2), "b": torch.tensor([0.5, -0.25])}

    def test_equal_runs_pass_and_say_the_bound(self):
        a = self.runs.make("a", params=self.base)
        b = self.runs.make("b", params={k: v * (1 + 1e-7) for k, v in self.base.items()})
        figure = self.h.same_training(a, b, 1e-5, "2 ranks = 1 rank")
        self.assertIn("bound 1e-05", figure)
        self.assertIn("4 steps", figure)

    def test_parameters_apart_fail_naming_the_tensor(self):
        a = self.runs.make("a", params=self.base)
        moved = dict(self.base, b=self.base["b"] + torch.tensor([0.0, 1e-3]))
        b = self.runs.make("b", params=moved)
        with self.assertRaises(CheckFailed) as e:
            self.h.same_training(a, b, 1e-5, "x")
        self.assertIn("(relative norm, b)", str(e.exception))

    def test_a_bias_updated_by_another_coefficient_fails_where_the_norm_of_the_whole_would_not(self):
        # The clipping defect's signature: every update 1.1e-4 larger. A bias that starts at 0
        # is all updates, so its relative difference is the coefficient's.
        start = {"w": torch.linspace(-1, 1, 6).reshape(3, 2)}
        update = {"w": torch.full((3, 2), 1e-3), "b": torch.tensor([0.01, -0.02])}
        one = {"w": start["w"] + update["w"], "b": update["b"]}
        other = {"w": start["w"] + update["w"] * (1 + 4e-4), "b": update["b"] * (1 + 4e-4)}
        a, b = self.runs.make("a", params=one), self.runs.make("b", params=other)
        with self.assertRaisesRegex(CheckFailed, r"relative norm, b"):
            self.h.same_parameters(a, b, 1e-4)

    def test_one_element_apart_by_rounding_twice_amplified_passes(self):
        # A ReLU on either side for one token: one element of a large tensor 1e-4 off.
        big = torch.linspace(-1, 1, 4096).reshape(64, 64)
        moved = big.clone()
        moved[3, 5] += 1e-4
        a, b = self.runs.make("a", params={"w": big}), self.runs.make("b", params={"w": moved})
        worst, largest = self.h.same_parameters(a, b, 1e-4)
        self.assertLess(worst, 1e-5)
        self.assertGreater(largest, 5e-5)

    def test_losses_apart_fail(self):
        a = self.runs.make("a", losses=(2.5, 2.4), params=self.base)
        b = self.runs.make("b", losses=(2.5, 2.41), params=self.base)
        with self.assertRaisesRegex(CheckFailed, "epoch training losses"):
            self.h.same_training(a, b, 1e-5, "x")

    def test_other_step_counts_fail(self):
        a = self.runs.make("a", steps=4, params=self.base)
        b = self.runs.make("b", steps=5, params=self.base)
        with self.assertRaisesRegex(CheckFailed, "4 optimizer steps against 5"):
            self.h.same_training(a, b, 1e-5, "x")

    def test_other_tensors_or_shapes_fail(self):
        a = self.runs.make("a", params=self.base)
        b = self.runs.make("b", params=dict(self.base, extra=torch.ones(1)))
        with self.assertRaisesRegex(CheckFailed, "other tensors"):
            self.h.same_parameters(a, b, 1e-5)
        c = self.runs.make("c", params=dict(self.base, w=torch.ones(2, 3)))
        with self.assertRaisesRegex(CheckFailed, "shapes"):
            self.h.same_parameters(a, c, 1e-5)

    def test_a_non_finite_parameter_fails(self):
        a = self.runs.make("a", params=self.base)
        b = self.runs.make("b", params=dict(self.base, b=torch.tensor([float("nan"), 0.0])))
        with self.assertRaisesRegex(CheckFailed, "not finite"):
            self.h.same_parameters(a, b, 1.0)

    def test_step_losses_apart_fail_from_the_first_step_beyond(self):
        a = {"json": {"step_losses": [1.0, 1.0, 1.0]}}
        b = {"json": {"step_losses": [1.0, 1.0, 1.1]}}
        with self.assertRaisesRegex(CheckFailed, "from step 3"):
            Harness.same_losses(a, b, 1e-3)
        self.assertIn("first 2 steps", Harness.same_losses(a, b, 1e-3, steps=2))

    def test_the_loader_check_fails_when_its_baseline_cannot_judge(self):
        self.assertEqual(machine.loader_verdict(960, 1000, cpu=False)[0], table.PASS)
        self.assertEqual(machine.loader_verdict(900, 1000, cpu=False)[0], table.BELOW)
        # A memory-fed baseline 7.9x slower than the files it judges (the H100 row): no verdict.
        with self.assertRaisesRegex(CheckFailed, "slower than the files"):
            machine.loader_verdict(3824, 486, cpu=False)
        # The CPU self-test's sizes cannot judge speed: it reports.
        self.assertEqual(machine.loader_verdict(3824, 486, cpu=True)[0], table.PASS)


class Provenance(unittest.TestCase):
    def rows(self, gpu, commit, at, checks, verdict="pass"):
        return {"gpu": gpu, "commit": commit, "finished_at": at, "device": "cuda", "gpus": 1,
                "checks": [{"path": c, "check": c, "tier": 1, "verdict": verdict, "figure": f"{c} on {gpu}", "seconds": 3.0, "gpu": gpu, "commit": commit,
                            "finished_at": at} for c in checks]}

    def test_a_merged_table_keeps_each_rows_provenance(self):
        h100 = self.rows("NVIDIA H100 80GB HBM3", "950766e", 1795794024, ["a", "b"])
        h200 = self.rows("NVIDIA H200", "eb26e4c", 1795843107, ["b", "c"])
        merged = table.merge([h100, h200])
        by_check = {r["check"]: r for r in merged["checks"]}
        self.assertEqual((by_check["a"]["gpu"], by_check["a"]["commit"]), ("NVIDIA H100 80GB HBM3", "950766e"))
        # A check both ran is the later table's, with the later run's provenance.
        self.assertEqual((by_check["b"]["gpu"], by_check["b"]["commit"], by_check["b"]["figure"]), ("NVIDIA H200", "eb26e4c", "b on NVIDIA H200"))
        md = table.render(merged["checks"], table.header_of(merged))
        self.assertIn("| 1 | a | pass | a on NVIDIA H100 80GB HBM3 |  | 3 | H100 80GB HBM3 950766e 2026-11-27 |", md)
        self.assertIn("| 1 | c | pass | c on NVIDIA H200 |  | 3 | H200 eb26e4c 2026-11-28 |", md)
        self.assertIn("Rows from H100 80GB HBM3 950766e 2026-11-27; H200 eb26e4c 2026-11-28", md)

    def test_a_check_not_run_later_keeps_its_earlier_row(self):
        first = self.rows("NVIDIA H200", "aaaaaaa", 1795000000, ["a"])
        later = self.rows("NVIDIA H200", "bbbbbbb", 1796000000, ["a"], verdict="not run (budget)")
        merged = table.merge([first, later])
        self.assertEqual([(r["commit"], r["verdict"]) for r in merged["checks"]], [("aaaaaaa", "pass")])

    def test_an_old_table_gets_its_own_provenance_on_its_rows(self):
        old = {"gpu": "NVIDIA H200", "commit": "eb26e4c", "finished_at": 1795843107,
               "checks": [{"path": "a", "verdict": "pass", "seconds": 2.0}, {"path": "b", "verdict": "not run (budget)", "seconds": None}]}
        rows = table.with_provenance(old)["checks"]
        self.assertEqual((rows[0]["gpu"], rows[0]["commit"], rows[0]["finished_at"]), ("NVIDIA H200", "eb26e4c", 1795843107))
        self.assertNotIn("commit", rows[1])

    def test_a_resumed_run_carries_passed_rows_unchanged(self):
        earlier = self.rows("NVIDIA H100 80GB HBM3", "950766e", 1795794024, ["only check"])
        h = Harness(fake_args(), "cuda", 1, "NVIDIA H200", "eb26e4c", earlier, None)
        h.check("only check", lambda: (table.PASS, "ran again"), 1, (1, 1))
        h.select()
        h.execute(lambda rows: None)
        self.assertEqual(h.rows, earlier["checks"], "carried as measured, never relabelled")

    def test_a_new_row_carries_this_run(self):
        h = fake_harness()
        h.check("x", lambda: (table.PASS, "fine"), 1, (1, 1))
        h.select()
        h.execute(lambda rows: None)
        self.assertEqual((h.rows[0]["gpu"], h.rows[0]["commit"]), ("NVIDIA Test GPU", "abc1234"))
        self.assertIsNotNone(h.rows[0]["finished_at"])


class Tiers(unittest.TestCase):
    def planned(self, device="cuda", committed=None):
        sys.path.insert(0, harness.BENCH)
        import gpu_check
        h = fake_harness(device, committed=committed)
        gpu_check.plan_all(h)
        return h

    def test_every_tier_fits_its_time_by_recorded_and_estimated_seconds(self):
        committed = table.read(os.path.join(harness.ROOT, "results", "gpu-check.json"), "test")
        h = self.planned(committed=committed)
        for t in tiers.NAMES:
            self.assertTrue(any(p.tier == t for p in h.plan), f"tier {t} has no checks")
            self.assertLessEqual(tiers.expected(h, t), tiers.TIER_SECONDS, f"tier {t}: {tiers.NAMES[t]}")
        self.assertEqual(sorted({p.tier for p in h.plan}), sorted(tiers.NAMES))

    def test_the_multi_rank_rows_come_first(self):
        h = self.planned()
        first = [p.path for p in h.plan[:5]]
        self.assertTrue(all(p.tier == 1 for p in h.plan[:20]))
        self.assertIn("exercise2 (Horovod style): 2 ranks x 20 = 1 rank x 40", first)

    def test_next_is_the_first_tier_the_committed_table_lacks(self):
        h = self.planned()
        self.assertEqual(tiers.next_tier(None, h), 1)
        ran = lambda tier: [{"path": p.path, "check": p.path, "verdict": "pass"} for p in h.plan if p.tier == tier]
        self.assertEqual(tiers.next_tier({"checks": ran(1)}, h), 2)
        self.assertEqual(tiers.next_tier({"checks": ran(1) + ran(2) + ran(4)}, h), 3)
        # A row left for the budget does not count as had.
        budget = [dict(r, verdict="not run (budget)") for r in ran(3)]
        self.assertEqual(tiers.next_tier({"checks": ran(1) + ran(2) + budget}, h), 3)
        everything = [r for t in tiers.NAMES for r in ran(t)]
        self.assertIsNone(tiers.next_tier({"checks": everything}, h))


class NcclFallback(unittest.TestCase):
    def test_a_refusal_by_nccl_reruns_over_mpi_and_the_row_says_so(self):
        h = fake_harness(gpus=1)
        calls = []

        def run(key, binary, args, ok=True, env=None, checkpoint=False):
            calls.append(args)
            refused = "--backend" in args and args[args.index("--backend") + 1] == "nccl"
            return {"code": 1 if refused else 0, "stderr": "error on rank 0: ncclCommInitRank failed: invalid usage" if refused else "", "stdout": ""}
        h.run = run
        ranks = multirank.Ranks(h)
        ranks.mode = "Default"
        ranks.run("row", "exercise2", ["--model", "cnn"], 2)
        self.assertEqual([a[a.index("--backend") + 1] for a in calls], ["nccl", "mpi"])
        self.assertTrue(all("--share-gpu" in a for a in calls), "2 ranks on 1 GPU share it")
        self.assertIn("NCCL refused: error on rank 0: ncclCommInitRank failed", ranks.over(2))
        self.assertEqual(ranks.verdict(), table.BELOW)
        # The later rows go over MPI straight away.
        ranks.run("row2", "exercise2", [], 2)
        self.assertEqual(calls[-1][calls[-1].index("--backend") + 1], "mpi")

    def test_a_failure_that_is_not_ncclS_is_a_failure(self):
        h = fake_harness(gpus=1)
        h.run = lambda *a, **k: {"code": 1, "stderr": "error: the loss is nan", "stdout": ""}
        ranks = multirank.Ranks(h)
        with self.assertRaisesRegex(CheckFailed, "the loss is nan"):
            ranks.run("row", "exercise2", [], 2)
        self.assertIsNone(ranks.refused)

    def test_ranks_within_the_gpus_do_not_share_and_an_exclusive_gpu_is_said(self):
        h = fake_harness(gpus=2)
        ranks = multirank.Ranks(h)
        self.assertNotIn("--share-gpu", ranks.flags(2))
        self.assertIn("--share-gpu", ranks.flags(4))
        ranks.mode = "Exclusive_Process"
        self.assertIsNone(ranks.needs(2))
        self.assertIn("Exclusive_Process", ranks.needs(4))


class Timings(unittest.TestCase):
    ROW = {"unit": "images/s", "rounds": "3", "rust_mode": "eager", "rust_throughput": "110", "rust_min": "105", "rust_max": "112",
           "fastest_peer": "fused", "fastest_peer_throughput": "100", "fastest_peer_min": "98", "fastest_peer_max": "101", "ratio_fastest": "1.08",
           "peers": "eager fused", "pytorch_throughput": "90", "pytorch_fused_throughput": "100", "rust_data_ms": "0.1", "rust_fwd_bwd_ms": "1.0",
           "rust_optim_ms": "0.2", "fastest_peer_data_ms": "0.1", "fastest_peer_fwd_bwd_ms": "1.1", "fastest_peer_optim_ms": "0.1"}

    def test_a_row_holds_ours_against_the_fastest_peer_with_spreads_and_phases(self):
        h = fake_harness()
        rows = [dict(self.ROW), dict(self.ROW, rust_mode="cuda-graph", ratio_fastest="0.9")]
        with mock.patch.object(timings, "run_bench", lambda *a, **k: rows):
            self.check_rows(h)

    def check_rows(self, h):
        [row] = timings.bench(h, "32", "resnet34", graph=False)
        self.assertEqual((row["verdict"], row["ratio"]), (table.BELOW, 1.08), "ResNet34's goal is 1.1x the fastest peer")
        self.assertIn("fastest peer fused 100 (98-101) images/s, 3 rounds", row["figure"])
        self.assertIn("peers eager 90, fused 100", row["figure"])
        self.assertIn("ms/step ours data 0.10, fwd+bwd 1.00, optimizer 0.20, fused data 0.10", row["figure"])
        self.assertEqual(row["extra"]["rust_mode"], "eager", "the whole bench row is kept")
        [cnn] = timings.bench(h, "32", "cnn", graph=False)
        self.assertEqual(cnn["verdict"], table.PASS)
        [graph] = timings.bench(h, "32", "cnn", graph=True)
        self.assertEqual((graph["verdict"], graph["ratio"]), (table.BELOW, 0.9), "the graph row is graph against graph")

    def test_a_row_without_a_ratio_against_the_fastest_peer_fails(self):
        h = fake_harness()
        with mock.patch.object(timings, "run_bench", lambda *a, **k: [dict(self.ROW, ratio_fastest="")]):
            with self.assertRaisesRegex(CheckFailed, "no ratio against the fastest peer"):
                timings.bench(h, "32", "cnn", graph=False)


class Docs(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp()
        for page in docs.PAGES:
            os.makedirs(os.path.dirname(os.path.join(self.root, page)), exist_ok=True)
            with open(os.path.join(self.root, page), "w") as f:
                f.write("# a page\n")
        self.recorded = {"checks": [{"path": "timing exercise1 cnn 32", "check": "timing exercise1 cnn 32: every PyTorch peer", "tier": 2, "verdict": "pass",
                                     "figure": "ours 2 vs fastest peer fused 1", "ratio": 2.0, "seconds": 9, "gpu": "NVIDIA H200", "commit": "abc1234",
                                     "finished_at": 1796000000, "extra": {"fastest_peer": "fused", "peers": "eager fused", "rounds": "3"}}]}
        self.plan = Tiers().planned().plan

    def write(self, page, text):
        with open(os.path.join(self.root, page), "w") as f:
            f.write(text)

    def test_a_block_is_written_from_the_table_and_a_stale_one_is_found(self):
        self.write("README.md", "<!-- gpu-check:timings -->\nold figures\n<!-- /gpu-check:timings -->\n")
        problems = docs.update(self.root, self.recorded, self.plan, check=True)
        self.assertTrue(any("README.md: its gpu-check blocks (timings)" in p for p in problems), problems)
        self.assertEqual(docs.update(self.root, self.recorded, self.plan, check=False), [])
        with open(os.path.join(self.root, "README.md")) as f:
            text = f.read()
        self.assertIn("| timing exercise1 cnn 32 | pass | ours 2 vs fastest peer fused 1 | 2.00x | the fastest of eager, fused; 3 rounds | H200 abc1234", text)
        self.assertEqual(docs.update(self.root, self.recorded, self.plan, check=True), [], "written, it is what the table gives")

    def test_what_ran_on_a_gpu_is_said_only_inside_a_block(self):
        self.write("docs/speed.md", "--cuda-graph: **Not yet run on a GPU**.\n")
        self.write("docs/course.md", "<!-- gpu-check:nope -->\n<!-- /gpu-check:nope -->\n")
        problems = docs.update(self.root, self.recorded, self.plan, check=True)
        self.assertTrue(any(p.startswith("docs/speed.md: says what has or has not run on a GPU outside") for p in problems), problems)
        self.assertTrue(any("unknown block gpu-check:nope" in p for p in problems), problems)


class Hung(Exception):
    """Not an OSError, which the writer might take for a refusal."""


@contextlib.contextmanager
def within(seconds):
    """The block must end within `seconds`: a write that blocks (opening a FIFO with no reader)
    fails the test instead of hanging it."""
    def hung(signum, frame):
        raise Hung(f"still blocked after {seconds} s")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class Writer(unittest.TestCase):
    """gpucheck/output.py: the rules of common/src/output.rs, for the Python side."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.victim = self.at("victim")
        with open(self.victim, "w") as f:
            f.write("precious\n")

    def at(self, name):
        return os.path.join(self.dir, name)

    def names(self):
        return sorted(os.listdir(self.dir))

    def read(self, path):
        with open(path) as f:
            return f.read()

    def assertVictimUntouched(self):
        self.assertEqual(self.read(self.victim), "precious\n")

    def test_the_new_content_replaces_the_old_and_nothing_else_is_left(self):
        path = self.at("run.json")
        output.write(path, "{\"old\": 1}\n")
        output.write(path, b"{\"new\": 2}\n")
        self.assertEqual(self.read(path), "{\"new\": 2}\n")
        self.assertEqual(self.names(), ["run.json", "victim"])

    def test_a_link_planted_at_the_name_is_replaced_and_its_target_untouched(self):
        source = self.at("source.svg")
        with open(source, "w") as f:
            f.write("<svg/>")
        for name, write, expected in [("run.json", lambda p: output.write(p, "{}"), "{}"),
                                      ("plan-check.csv", lambda p: self.fill(p, "a,b\n"), "a,b\n"),
                                      ("chart.svg", lambda p: output.copy(source, p), "<svg/>")]:
            path = self.at(name)
            os.symlink(self.victim, path)
            write(path)
            self.assertVictimUntouched()
            self.assertFalse(os.path.islink(path), f"{name}: the link was replaced, not followed")
            self.assertEqual(self.read(path), expected)

    filled = False

    def fill(self, path, text):
        with output.replacing(path) as f:
            self.filled = True
            f.write(text)

    def test_a_fifo_or_a_folder_at_the_name_is_refused_without_hanging_and_left_in_place(self):
        fifo, folder, source = self.at("run.safetensors"), self.at("run.json"), self.at("source")
        os.mkfifo(fifo)
        os.mkdir(folder)
        with open(source, "w") as f:
            f.write("x")
        for path, what, still in [(fifo, "a FIFO", lambda p: os.path.exists(p) and not os.path.isdir(p) and __import__("stat").S_ISFIFO(os.lstat(p).st_mode)),
                                  (folder, "a folder", os.path.isdir)]:
            for write in [lambda p: output.write(p, "x"), lambda p: self.fill(p, "x"), lambda p: output.append(p, "x\n"), lambda p: output.copy(source, p)]:
                with within(5), self.assertRaises(output.Refused) as caught:
                    write(path)
                self.assertFalse(self.filled, "refused before anything is written")
                message = str(caught.exception)
                self.assertIn(f"{path} is {what}, not a regular file: not replacing it", message)
                self.assertNotIn("\n", message, "one line")
                self.assertTrue(still(path), f"{what} is left in place")
        self.assertEqual(self.names(), ["run.json", "run.safetensors", "source", "victim"], "no temporary file is left")

    def test_the_open_of_an_appended_file_itself_refuses_a_fifo_put_there_after_the_check(self):
        # The check before the open passes (the FIFO is not there yet, say): the open must not
        # block on it (O_NONBLOCK) and must refuse what it opened.
        fifo = self.at("runs.jsonl")
        os.mkfifo(fifo)
        with mock.patch.object(output, "check_file", lambda path: None), within(5), self.assertRaises(output.Refused) as caught:
            output.append(fifo, "x\n")
        self.assertIn("is a FIFO, not a regular file: not writing to it", str(caught.exception))
        # With a reader, the open succeeds: what it opened is looked at before a byte is written.
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            with mock.patch.object(output, "check_file", lambda path: None), within(5), self.assertRaises(output.Refused) as caught:
                output.append(fifo, "x\n")
            self.assertIn(f"{fifo} is not a regular file: not writing to it", str(caught.exception))
            try:
                written = os.read(reader, 10)  # b"" at its end: nothing was written to it
            except BlockingIOError:
                written = b""
            self.assertEqual(written, b"")
        finally:
            os.close(reader)

    def test_append_adds_to_a_regular_file_and_refuses_a_link(self):
        log = self.at("command.log")
        output.append(log, "one\n")
        output.append(log, b"two\n")
        self.assertEqual(self.read(log), "one\ntwo\n")
        planted = self.at("exercise1.csv")
        os.symlink(self.victim, planted)
        with self.assertRaises(output.Refused) as caught:
            output.append(planted, "row\n")
        self.assertIn(f"{planted} is a symbolic link: not writing through it", str(caught.exception))
        self.assertVictimUntouched()
        self.assertTrue(os.path.islink(planted))
        # A link to nothing, which a plain append would create the file at the end of.
        dangling = self.at("runs.jsonl")
        os.symlink(self.at("made-elsewhere"), dangling)
        with self.assertRaises(output.Refused):
            output.append(dangling, "row\n")
        self.assertFalse(os.path.exists(self.at("made-elsewhere")))

    def test_a_benchs_table_header_is_made_once_and_what_append_refuses_is_refused_before(self):
        table = self.at("bench-data.csv")
        output.header(table, "a,b")
        output.append(table, "1,2\n")
        output.header(table, "a,b")  # a table that exists keeps its rows
        self.assertEqual(self.read(table), "a,b\n1,2\n")
        linked, fifo, folder = self.at("bench-ps.csv"), self.at("bench-plan.csv"), self.at("bench-parallel.csv")
        os.symlink(self.victim, linked)
        os.mkfifo(fifo)
        os.mkdir(folder)
        for planted, says in [(linked, "is a symbolic link: not appending through it"), (fifo, "is a FIFO, not a regular file"), (folder, "is a folder, not a regular file")]:
            with self.assertRaises(output.Refused) as caught:
                output.header(planted, "a,b")
            self.assertIn(f"{planted} {says}", str(caught.exception))
        self.assertVictimUntouched()
        self.assertTrue(os.path.islink(linked) and stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.isdir(folder))

    def test_the_shell_scripts_way_in_is_one_line_and_exit_2_on_a_refusal(self):
        bench = os.path.dirname(os.path.dirname(os.path.abspath(output.__file__)))
        run = lambda *args, given=b"": subprocess.run([sys.executable, "-m", "gpucheck.output", *args], input=given, capture_output=True, cwd=bench, timeout=30)
        table = self.at("bench-ps.csv")
        self.assertEqual(run("header", table, "x,y").returncode, 0)
        self.assertEqual(run("append", table, given=b"1,2\n").returncode, 0)
        self.assertEqual(self.read(table), "x,y\n1,2\n")
        fifo = self.at("fifo.csv")
        os.mkfifo(fifo)
        for args in [("header", fifo, "x,y"), ("append", fifo)]:
            refused = run(*args, given=b"1,2\n")
            self.assertEqual(refused.returncode, 2, refused.stderr)
            self.assertEqual(refused.stderr.decode().count("\n"), 1, refused.stderr)
            self.assertTrue(refused.stderr.startswith(b"error: ") and b"is a FIFO" in refused.stderr, refused.stderr)
        self.assertEqual(run("frobnicate").returncode, 2)

    def test_a_killed_writers_temporaries_are_removed_by_the_next_write_a_running_ones_kept(self):
        path = self.at("gpu-check.json")
        # No process has pid 4,000,000,000 (above any pid_max); this process's parent runs.
        dead = self.at(f"{output.temporary_prefix(path, 4_000_000_000)}AbC123.tmp")
        alive = self.at(f"{output.temporary_prefix(path, os.getppid())}XyZ789.tmp")
        other = self.at(f"{output.temporary_prefix(self.at('gpu-check.md'), 4_000_000_000)}AbC123.tmp")
        for leftover in [dead, alive, other]:
            with open(leftover, "w") as f:
                f.write("half")
        planted = self.at(f"{output.temporary_prefix(path, 4_000_000_001)}Lnk.tmp")
        os.symlink(self.victim, planted)
        output.write(path, "{}")
        self.assertFalse(os.path.exists(dead), "the dead writer's temporary file is removed")
        self.assertTrue(os.path.exists(alive), "a running writer's is left alone")
        self.assertTrue(os.path.exists(other), "another name's is not this write's to remove")
        self.assertTrue(os.path.islink(planted), "a link under such a name is not this writer's")
        self.assertVictimUntouched()
        # Through `replacing` too.
        with open(dead, "w") as f:
            f.write("half")
        self.fill(path, "{}")
        self.assertFalse(os.path.exists(dead))

    def test_an_exception_inside_replacing_leaves_the_old_file_and_no_temporary(self):
        path = self.at("plan-check.csv")
        output.write(path, "old,rows\n")
        with self.assertRaises(RuntimeError):
            with output.replacing(path) as f:
                f.write("new,ro")
                f.flush()
                raise RuntimeError("No space left on device")
        self.assertEqual(self.read(path), "old,rows\n")
        self.assertEqual(self.names(), ["plan-check.csv", "victim"])

    def test_a_folder_put_at_the_name_while_it_is_written_is_not_replaced(self):
        path = self.at("run.json")
        output.write(path, "old")
        with self.assertRaises(output.Refused) as caught:
            with output.replacing(path) as f:
                f.write("new")
                os.unlink(path)
                os.mkdir(path)
        self.assertIn("is a folder, not a regular file: not replacing it", str(caught.exception))
        self.assertTrue(os.path.isdir(path))
        self.assertEqual(self.names(), ["run.json", "victim"])

    def test_the_temporary_file_swapped_for_a_link_while_written_is_not_moved_into_place(self):
        path = self.at("course-gpu.tar.gz")
        with self.assertRaises(output.Refused) as caught:
            with output.replacing(path, "wb") as f:
                for name in self.names():
                    if name.endswith(".tmp"):
                        os.unlink(self.at(name))
                        os.symlink(self.victim, self.at(name))
                f.write(b"archive\n")
        self.assertIn("was replaced by someone else while it was written", str(caught.exception))
        self.assertVictimUntouched()
        self.assertFalse(os.path.lexists(path), "nothing was put at the target's name")

    def test_the_folders_a_run_names_itself_are_never_links(self):
        elsewhere = self.at("elsewhere")
        os.mkdir(elsewhere)
        run = os.path.join(self.dir, "results", "course-gpu")
        output.folder(run)
        output.folder(run)  # there already: used as it is
        self.assertTrue(os.path.isdir(run))
        planted = os.path.join(self.dir, "results", "exercise1-cnn")
        os.symlink(elsewhere, planted)
        with self.assertRaises(output.Refused) as caught:
            output.folder(planted)
        self.assertIn(f"{planted} is a symbolic link: not writing through it", str(caught.exception))
        with self.assertRaises(output.Refused) as caught:
            output.folder(self.victim)
        self.assertIn("is a regular file, not a folder", str(caught.exception))
        self.assertEqual(os.listdir(elsewhere), [])

    def test_written_files_are_readable_as_plainly_created_ones(self):
        ours, plain = self.at("ours"), self.at("plain")
        output.write(ours, "x")
        output.append(self.at("appended"), "x")
        with open(plain, "w") as f:
            f.write("x")
        mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
        self.assertEqual(mode(ours), mode(plain))
        self.assertEqual(mode(self.at("appended")), mode(plain))

    def test_the_course_archive_replaces_a_planted_link_and_its_folder_refuses_one(self):
        results = self.at("results")
        os.mkdir(results)
        run_dir = self.at("run")
        os.mkdir(run_dir)
        with open(os.path.join(run_dir, "exercise1-cnn-cuda.json"), "w") as f:
            f.write("{}")
        h = types.SimpleNamespace(args=types.SimpleNamespace(results=results), gpu_name="NVIDIA Test GPU", commit="abc1234")
        run = {"command": ["/bin/exercise1", "--model", "cnn"], "stdout": "epoch 1\n", "dir": run_dir}
        # Links planted at every name the tier writes in <results>, the folder's own excepted.
        kept = os.path.join(results, "course-gpu", "exercise1-cnn")
        os.makedirs(kept)
        archive = os.path.join(results, "course-gpu.tar.gz")
        planted = [archive, os.path.join(results, ".course-gpu.tar.gz.partial"), os.path.join(results, "course-gpu", "RUN.txt"),
                   os.path.join(kept, "stdout.txt"), os.path.join(kept, "exercise1-cnn-cuda.json")]
        for path in planted:
            os.symlink(self.victim, path)
        course.keep(h, "exercise1-cnn", run)
        self.assertVictimUntouched()
        self.assertEqual([p for p in planted if os.path.islink(p)], [planted[1]], "each link at a name written was replaced, not followed")
        os.unlink(planted[1])
        import tarfile
        with tarfile.open(archive) as tar:
            self.assertEqual(sorted(tar.getnames()), ["course-gpu", "course-gpu/RUN.txt", "course-gpu/exercise1-cnn", "course-gpu/exercise1-cnn/exercise1-cnn-cuda.json",
                                                      "course-gpu/exercise1-cnn/stdout.txt"])
        self.assertEqual(sorted(os.listdir(results)), ["course-gpu", "course-gpu.tar.gz"], "no temporary file is left")
        # A link planted at a run's folder: nothing is written through it.
        elsewhere = self.at("elsewhere")
        os.mkdir(elsewhere)
        os.symlink(elsewhere, os.path.join(results, "course-gpu", "why_gpus"))
        with self.assertRaisesRegex(output.Refused, "why_gpus is a symbolic link: not writing through it"):
            course.keep(h, "why_gpus", run)
        self.assertEqual(os.listdir(elsewhere), [])

    def test_the_harness_logs_and_tables_never_write_through_a_planted_link(self):
        h = fake_harness(device="cpu")
        # command.log is appended to: a link there is refused.
        out = output.folder(os.path.join(h.work, "e1"))
        os.symlink(self.victim, os.path.join(out, "command.log"))
        with self.assertRaisesRegex(output.Refused, "command.log is a symbolic link: not writing through it"):
            h.record("e1", out, ["exercise1"], 0, "", "", 1.0, True)
        # A run's folder in the work folder: a link there is refused.
        os.symlink(self.dir, os.path.join(h.work, "e2"))
        with self.assertRaisesRegex(output.Refused, "e2 is a symbolic link"):
            h.run("e2", "exercise1", [])
        # bench.sh's log and plan-check.csv are replaced: a link there is not followed.
        csv_path = os.path.join(h.work, "bench-32-cnn-False-all.csv")
        os.symlink(self.victim, csv_path + ".log")

        def bench(command, env=None, cwd=None):
            with open(env["BENCH_CSV"], "w") as f:
                f.write("a,b\n1,2\n")
            return 0, "out\n", "err\n", 1.0
        with mock.patch.object(h, "spawn", bench), mock.patch.object(h, "cifar_full", lambda: "/nowhere"):
            self.assertEqual(timings.run_bench(h, "32", "cnn", False), [{"a": "1", "b": "2"}])
        self.assertEqual(self.read(csv_path + ".log"), "out\nerr\n")
        profile = os.path.join(h.work, "profile.json")
        with open(profile, "w") as f:
            json.dump({"model": {"ntoken": 10}}, f)
        ranked = {"ranked": [{"command": "exercise3 --tp 1", "step_s": 0.1, "memory_bytes": 100, "compute_s": 1, "tp_comm_s": 0, "bubble_s": 0,
                              "exposed_comm_s": 0, "optimizer_s": 0}]}
        measured = {"json": {"global_batch": 2, "bptt": 8, "steady_throughput": 160, "peak_memory": [{"training_peak_bytes": 200, "baseline_bytes": 100}]}}
        plan_check = os.path.join(h.args.results, "plan-check.csv")
        os.symlink(self.victim, plan_check)
        with mock.patch.object(h, "spawn", lambda *a, **k: (0, json.dumps(ranked), "", 1.0)), mock.patch.object(h, "run", lambda *a, **k: measured):
            machine.plan_against_runs(h, profile)
        self.assertFalse(os.path.islink(plan_check))
        self.assertTrue(self.read(plan_check).startswith("bench_started_at,cluster,"))
        self.assertVictimUntouched()


class Scripts(unittest.TestCase):
    """A refusal of the one writer is one line and exit 2 from the scripts, without hanging."""

    BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def script(self, name, *args):
        return subprocess.run([sys.executable, os.path.join(self.BENCH, name), *args], capture_output=True, text=True, timeout=30)

    def test_gpu_check_merge_refuses_a_fifo_at_the_table_and_writes_neither_file(self):
        out = tempfile.mkdtemp()
        recorded = os.path.join(out, "recorded.json")
        with open(recorded, "w") as f:
            json.dump({"device": "cuda", "gpu": "NVIDIA H200", "commit": "abc1234", "finished_at": 1796000000,
                       "checks": [{"path": "p", "check": "p", "tier": 1, "verdict": "pass", "seconds": 3}]}, f)
        os.mkfifo(os.path.join(out, "gpu-check.json"))
        done = self.script("gpu_check.py", "--merge", recorded, "--out", out)
        self.assertEqual(done.returncode, 2, done.stderr)
        self.assertEqual(done.stderr.strip().count("\n"), 0, f"one line: {done.stderr}")
        self.assertIn("gpu-check: " + os.path.join(out, "gpu-check.json") + " is a FIFO, not a regular file", done.stderr)
        self.assertEqual(sorted(os.listdir(out)), ["gpu-check.json", "recorded.json"], "the .md is not written either")

    def test_bench_report_refuses_a_link_at_its_runs_file(self):
        out = tempfile.mkdtemp()
        victim, runs, results = os.path.join(out, "victim"), os.path.join(out, "runs.jsonl"), os.path.join(out, "rust.json")
        with open(victim, "w") as f:
            f.write("precious\n")
        os.symlink(victim, runs)
        with open(results, "w") as f:
            json.dump({"steps": 10, "throughput": 100.0, "train_time_s": 1.0, "params": 5, "data_wait_s": 0.1, "forward_backward_s": 0.5, "optimizer_s": 0.2}, f)
        done = self.script("bench_report.py", "record", "--runs", runs, "--entry", "cnn", "--side", "rust", "--round", "1", "--rust-json", results)
        self.assertEqual(done.returncode, 2, done.stderr)
        self.assertEqual(done.stderr.strip(), f"error: {runs} is a symbolic link: not writing through it (remove it, or choose another folder)")
        with open(victim) as f:
            self.assertEqual(f.read(), "precious\n")

    def test_bench_report_refuses_a_fifo_at_its_csv_without_hanging(self):
        out = tempfile.mkdtemp()
        runs, csv_path = os.path.join(out, "runs.jsonl"), os.path.join(out, "bench.csv")
        with open(runs, "w") as f:
            for side, figures in [("rust", [900.0, 150.0, 160.0]), ("eager", [900.0, 100.0, 100.0])]:
                for round_, throughput in enumerate(figures):
                    f.write(json.dumps({"entry": "cnn", "impl": side, "round": round_, "others": 0.0, "throughput": throughput, "steady": True,
                                        "examples_per_step": 100.0, "steps": 10, "params": 5, "data_wait_s": 0.01, "forward_backward_s": 0.2,
                                        "optimizer_s": 0.03, "graph_replay_s": None, "phase_clock": "host", "loader": "memory"}) + "\n")
        os.mkfifo(csv_path)
        done = self.script("bench_report.py", "table", "--runs", runs, "--csv", csv_path)
        self.assertEqual(done.returncode, 2, done.stderr)
        self.assertEqual(done.stderr.strip(), f"error: {csv_path} is a FIFO, not a regular file: not replacing it (remove it, or write elsewhere)")
        self.assertEqual(sorted(os.listdir(out)), ["bench.csv", "runs.jsonl"])


if __name__ == "__main__":
    unittest.main()
