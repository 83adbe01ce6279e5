#!/usr/bin/python3
"""The optimizer state on the wire, driven with grpcio: GetState (every
refusal with its exact status and message, state unchanged; a large state
over several messages, covered exactly; a state read at one version while
pushes run) and Create with step / init_state / rms / replace (resume on a
new, empty shard continues bit for bit; every refusal changes nothing)."""
import os
import subprocess
import threading
import unittest

import numpy as np

import fpsharness as H


def get_state(stub, names, timeout=30):
    """{name: {"row"/"col"/"var"/"mom": array}}, {name: TensorState}, messages."""
    pb, _, _ = H.stubs()
    arrays, infos, n = {}, {}, 0
    kinds = {pb.STATE_ROW: "row", pb.STATE_COL: "col", pb.STATE_VAR: "var", pb.STATE_MOM: "mom"}
    for m in stub.GetState(pb.GetStateRequest(names=names), timeout=timeout):
        n += 1
        for s in m.slices:
            a = arrays.setdefault(s.name, {}).setdefault(kinds[s.kind], {})
            a[s.offset] = np.frombuffer(s.data, "<f4")
        for t in m.tensors:
            infos[t.name] = t
    out = {}
    for name, kinds_ in arrays.items():
        out[name] = {}
        for k, parts in kinds_.items():
            flat, at = [], 0
            for off in sorted(parts):
                assert off == at, (name, k, off, at)  # no gap, no overlap
                flat.append(parts[off])
                at += parts[off].size
            out[name][k] = np.concatenate(flat)
    return out, infos, n


class GetState(unittest.TestCase):
    ARGS = ("--mode", "async")

    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()
        cls.srv = H.Server(*cls.ARGS)
        cls.p0 = np.linspace(-1, 1, 12, dtype=np.float32)
        H.create(cls.srv.stub, "w", [3, 4], cls.p0)
        H.create(cls.srv.stub, "late", [4])  # no values: still initialising
        H.push(cls.srv.stub, 0, 0, {"w": ([3, 4], np.ones(12, np.float32))})

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def assertStatus(self, fn, code, *words):
        with self.assertRaises(self.grpc.RpcError) as cm:
            fn()
        e = cm.exception
        self.assertEqual(e.code(), code, e.details())
        for w in words:
            self.assertIn(w, e.details())

    def test_reads_one_tensor(self):
        arrays, infos, _ = get_state(self.srv.stub, ["w"])
        t = infos["w"]
        self.assertEqual((t.version, t.step, t.row_elements, t.col_elements, t.var_elements, t.mom_elements),
                         (1, 1, 3, 4, 0, 0))
        self.assertEqual((t.lr, t.weight_decay), (0.01, 0.0))
        # A gradient of ones: at t = 1 the state is exactly mean(g^2) = 1.
        np.testing.assert_array_equal(arrays["w"]["row"], np.ones(3, np.float32))
        np.testing.assert_array_equal(arrays["w"]["col"], np.ones(4, np.float32))
        self.assertEqual(set(arrays["w"]), {"row", "col"})

    def test_unknown_tensor(self):
        self.assertStatus(lambda: get_state(self.srv.stub, ["w", "nope"]), self.grpc.StatusCode.NOT_FOUND,
                          "'nope'", "not found")

    def test_bad_names(self):
        self.assertStatus(lambda: get_state(self.srv.stub, [""]), self.grpc.StatusCode.INVALID_ARGUMENT,
                          "name is empty")
        self.assertStatus(lambda: get_state(self.srv.stub, ["x" * 300]), self.grpc.StatusCode.INVALID_ARGUMENT,
                          "300 bytes long")
        self.assertStatus(lambda: get_state(self.srv.stub, ["w", "w"]), self.grpc.StatusCode.INVALID_ARGUMENT,
                          "'w'", "named twice")

    def test_initialising_tensor(self):
        self.assertStatus(lambda: get_state(self.srv.stub, ["late"]), self.grpc.StatusCode.FAILED_PRECONDITION,
                          "'late'", "still initialising")

    def test_empty_request(self):
        arrays, infos, n = get_state(self.srv.stub, [])
        self.assertEqual((arrays, infos, n), ({}, {}, 1))

    def test_state_unchanged_by_reads(self):
        _, ts0 = H.stats(self.srv.stub)
        for _ in range(3):
            get_state(self.srv.stub, ["w"])
        _, ts1 = H.stats(self.srv.stub)
        self.assertEqual(ts0["w"].version, ts1["w"].version)


class Cli(unittest.TestCase):
    def test_pull_state(self):
        cli = os.environ.get("FPS_CLI", os.path.join(H.REPO, "build", "client", "factorps"))
        if not os.path.exists(cli):
            self.skipTest("factorps CLI not built")
        srv = H.Server("--mode", "async")
        try:
            H.create(srv.stub, "w", [3, 4], np.zeros(12, np.float32))
            H.push(srv.stub, 0, 0, {"w": ([3, 4], np.full(12, 2.0, np.float32))})
            out = subprocess.run([cli, "pull", "--shards", srv.addr, "--state", "w"], capture_output=True,
                                 text=True, timeout=30)
            self.assertEqual(out.returncode, 0, out.stderr)
            for w in ("w  shard 0  version 1", "state: step 1", "last lr 0.01", "7 elements (AdamW: 24)",
                      "row (3):  min 4  max 4", "col (4):  min 4  max 4"):
                self.assertIn(w, out.stdout)
            bad = subprocess.run([cli, "pull", "--shards", srv.addr, "--state", "nope"], capture_output=True,
                                 text=True, timeout=30)
            self.assertEqual(bad.returncode, 1)
            self.assertIn("'nope'", bad.stderr)
        finally:
            srv.stop()


class BigState(unittest.TestCase):
    def test_large_state_over_several_messages(self):
        pb, _, _ = H.stubs()
        srv = H.Server("--mode", "async")
        try:
            n = 3 * (1 << 20)  # 12 MiB of var + 12 MiB of momentum: several 4 MiB messages
            opt = H.optimizer("hf", lr=1e-3, relative_step=False, beta1=0.9)
            H.create(srv.stub, "v", [n], np.zeros(n, np.float32), opt=opt)
            g = np.linspace(-1, 1, n, dtype=np.float32)
            H.push(srv.stub, 0, 0, {"v": ([n], g)})
            arrays, infos, msgs = get_state(srv.stub, ["v"], timeout=60)
            self.assertGreaterEqual(msgs, 6)
            t = infos["v"]
            self.assertEqual((t.var_elements, t.mom_elements, t.row_elements, t.col_elements), (n, n, 0, 0))
            self.assertEqual(arrays["v"]["var"].size, n)
            self.assertEqual(arrays["v"]["mom"].size, n)
            # hf: v = (1 - b2) * (g^2 + eps1) with b2 = 1 - 1^-0.8 = 0 at t = 1.
            np.testing.assert_array_equal(arrays["v"]["var"], (g * g + np.float32(1e-30)).astype(np.float32))
        finally:
            srv.stop()

    def test_one_version_while_pushing(self):
        # Every read sees step == version (both updated under the lock).
        srv = H.Server("--mode", "async")
        try:
            H.create(srv.stub, "w", [64, 64], np.zeros(4096, np.float32))
            stop = threading.Event()

            def pusher():
                s = 0
                while not stop.is_set():
                    H.push(srv.stub, 0, s, {"w": ([64, 64], np.ones(4096, np.float32))}, skip_params=True)
                    s += 1
            th = threading.Thread(target=pusher)
            th.start()
            try:
                seen = set()
                for _ in range(50):
                    _, infos, _ = get_state(srv.stub, ["w"])
                    self.assertEqual(infos["w"].step, infos["w"].version)
                    seen.add(infos["w"].version)
            finally:
                stop.set()
                th.join(30)
            self.assertGreater(len(seen), 1)
        finally:
            srv.stop()


SHAPES = {"w": [3, 4], "m": [5]}
OPTS = {"w": dict(), "m": dict(flavor="hf", lr=1e-3, relative_step=False, beta1=0.9, scale_parameter=False)}


def opt_of(name):
    o = dict(OPTS[name])
    return H.optimizer(o.pop("flavor", "torch"), **o)


def grads(step):
    return {n: (sh, np.sin(np.arange(int(np.prod(sh)), dtype=np.float32) * (step + 1)).astype(np.float32))
            for n, sh in SHAPES.items()}


def state_slices(pb, arrays, name, chunk=None):
    kinds = {"row": pb.STATE_ROW, "col": pb.STATE_COL, "var": pb.STATE_VAR, "mom": pb.STATE_MOM}
    out = []
    for k, a in arrays.get(name, {}).items():
        step = chunk or max(a.size, 1)
        for off in range(0, a.size, step):
            out.append(pb.StateSlice(kind=kinds[k], offset=off, data=a[off:off + step].astype("<f4").tobytes()))
    return out


class Resume(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.grpc = H.stubs()

    def assertStatus(self, fn, code, *words):
        with self.assertRaises(self.grpc.RpcError) as cm:
            fn()
        e = cm.exception
        self.assertEqual(e.code(), code, e.details())
        for w in words:
            self.assertIn(w, e.details())

    def tc(self, name, init=None, **kw):
        pb = self.pb
        sl = None if init is None else pb.TensorSlice(dtype=pb.DTYPE_F32, data=np.asarray(init, "<f4").tobytes())
        shape = kw.pop("shape", SHAPES.get(name))
        opt = kw.pop("opt", None) or opt_of(name)
        return pb.TensorCreate(name=name, shape=shape, optimizer=opt, init=sl, **kw)

    def create(self, stub, *tcs):
        return stub.Create(self.pb.CreateRequest(tensors=list(tcs), shard_id=0, shard_count=1), timeout=10)

    def trained(self, steps=3):
        """A shard with both tensors after `steps` pushes; its params and state."""
        srv = H.Server("--mode", "async")
        p0 = {n: np.linspace(-1, 1, int(np.prod(sh)), dtype=np.float32) for n, sh in SHAPES.items()}
        for n in SHAPES:
            H.create(srv.stub, n, SHAPES[n], p0[n], opt=opt_of(n))
        for s in range(steps):
            H.push(srv.stub, 0, s, grads(s))
        params, _ = H.pull(srv.stub, SHAPES)
        arrays, infos, _ = get_state(srv.stub, list(SHAPES))
        return srv, params, arrays, infos

    def test_resume_continues_bit_for_bit(self):
        a, params, arrays, infos = self.trained()
        b = H.Server("--mode", "async")
        try:
            pb = self.pb
            for n in SHAPES:
                r = self.create(b.stub, self.tc(n, params[n].reshape(-1), step=infos[n].step, rms=infos[n].rms,
                                                init_state=state_slices(pb, arrays, n)))
                self.assertTrue(r.tensors[0].ready and r.tensors[0].created)
                self.assertEqual(r.tensors[0].version, 3)
            arrays_b, infos_b, _ = get_state(b.stub, list(SHAPES))
            for n in SHAPES:
                self.assertEqual((infos_b[n].version, infos_b[n].step, infos_b[n].rms),
                                 (infos[n].version, infos[n].step, infos[n].rms))
                for k in arrays[n]:
                    np.testing.assert_array_equal(arrays_b[n][k], arrays[n][k])
            for s in range(3, 6):
                ga, va = H.push(a.stub, 0, s, grads(s))
                gb, vb = H.push(b.stub, 0, s, grads(s))
                self.assertEqual(va, vb)
                for n in SHAPES:
                    np.testing.assert_array_equal(ga[n], gb[n])
        finally:
            a.stop()
            b.stop()

    def test_resume_over_several_creates(self):
        a, params, arrays, infos = self.trained(2)
        a.stop()
        b = H.Server("--mode", "async")
        try:
            pb = self.pb
            r = self.create(b.stub, self.tc("w", params["w"].reshape(-1), step=2))
            self.assertFalse(r.tensors[0].ready)  # the state is still missing
            self.assertStatus(lambda: H.pull(b.stub, {"w": [3, 4]}), self.grpc.StatusCode.FAILED_PRECONDITION,
                              "'w'", "still initialising")
            self.assertStatus(lambda: self.create(b.stub, self.tc("w", step=3, init_state=state_slices(
                pb, arrays, "w"))), self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "being created at step 2, not 3")
            sl = state_slices(pb, arrays, "w", chunk=2)
            r = self.create(b.stub, self.tc("w", step=2, init_state=sl[:2]))
            self.assertFalse(r.tensors[0].ready)
            r = self.create(b.stub, self.tc("w", step=2, init_state=sl[2:]))
            self.assertTrue(r.tensors[0].ready)
            self.assertEqual(r.tensors[0].version, 2)
            got, ver = H.pull(b.stub, {"w": [3, 4]})
            np.testing.assert_array_equal(got["w"], params["w"])
            self.assertEqual(ver["w"], 2)
            # A value-less Create (another worker waiting) matches as ever.
            self.assertTrue(self.create(b.stub, self.tc("w")).tensors[0].ready)
        finally:
            b.stop()

    def test_refusals_change_nothing(self):
        srv = H.Server("--mode", "async")
        try:
            pb = self.pb
            p = np.ones(12, np.float32)
            ok = [pb.StateSlice(kind=pb.STATE_ROW, data=np.ones(3, "<f4").tobytes()),
                  pb.StateSlice(kind=pb.STATE_COL, data=np.ones(4, "<f4").tobytes())]

            def st(kind, vals, offset=0):
                return pb.StateSlice(kind=kind, offset=offset, data=np.asarray(vals, "<f4").tobytes())
            cases = [
                (dict(init_state=ok), "init_state needs a step > 0"),
                # A version counted up from 2^64 - 1 would wrap to 0.
                (dict(step=2**64 - 1, init_state=ok), "past the largest a tensor may resume at (2^53)"),
                (dict(step=2**53 + 1, init_state=ok), "past the largest"),
                (dict(step=1, init_state=[st(pb.STATE_VAR, [1])]), "has no var state"),
                (dict(step=1, init_state=[st(pb.STATE_MOM, [1])]), "has no mom state"),
                (dict(step=1, init_state=[st(0, [1])]), "no valid kind"),
                (dict(step=1, init_state=[st(pb.STATE_ROW, [1, 1], offset=2)]), "out of range"),
                (dict(step=1, init_state=[st(pb.STATE_ROW, [1, -1, 1])]), "never negative"),
                (dict(step=1, init_state=[st(pb.STATE_COL, [1, np.nan, 1, 1])]), "NaN or Inf"),
                (dict(step=1, init_state=[st(pb.STATE_ROW, [1, 1]), st(pb.STATE_ROW, [1, 1], offset=1)]),
                 "overlaps"),
                (dict(step=1, rms=0.5, init_state=ok), "rms is hf state"),
                (dict(step=1, init_state=[pb.StateSlice(kind=pb.STATE_ROW, data=b"\0" * 5)]),
                 "not a whole number"),
            ]
            for kw, word in cases:
                with self.subTest(word=word):
                    self.assertStatus(lambda: self.create(srv.stub, self.tc("w", p, **kw)),
                                      self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", word)
            _, ts = H.stats(srv.stub)
            self.assertEqual(ts, {})  # nothing was created
            m = [st(pb.STATE_VAR, np.ones(5)), st(pb.STATE_MOM, np.ones(5))]
            self.assertStatus(lambda: self.create(srv.stub, self.tc("m", np.ones(5), step=1, rms=float("nan"),
                                                                    init_state=m)),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "'m'", "finite float32")
            self.assertStatus(lambda: self.create(srv.stub, self.tc("m", np.ones(5), step=1, rms=0.1, init_state=m)),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "'m'", "finite float32")  # not a float32
            r = self.create(srv.stub, self.tc("m", np.ones(5), step=1, rms=0.5, init_state=m))
            self.assertTrue(r.tensors[0].ready)
        finally:
            srv.stop()

    def test_replace(self):
        a, params, arrays, infos = self.trained(2)
        try:
            pb = self.pb
            H.stats(a.stub)
            new = np.full(12, 0.25, np.float32)
            # Not everything in this call: refused, nothing changed.
            self.assertStatus(lambda: self.create(a.stub, self.tc("w", new[:0], replace=True)),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "must carry all 12 values")
            half = state_slices(pb, arrays, "w")[:1]
            self.assertStatus(lambda: self.create(a.stub, self.tc("w", new, replace=True, step=9, init_state=half)),
                              self.grpc.StatusCode.INVALID_ARGUMENT, "'w'", "whole state", "col: 0 of 4")
            self.assertStatus(lambda: self.create(a.stub, self.tc("w", new, replace=True, shape=[4, 3])),
                              self.grpc.StatusCode.ALREADY_EXISTS, "'w'")
            got, ver = H.pull(a.stub, {"w": [3, 4]})
            np.testing.assert_array_equal(got["w"], params["w"])
            self.assertEqual(ver["w"], 2)
            # A full replace at step 9 with a given state.
            r = self.create(a.stub, self.tc("w", new, replace=True, step=9,
                                            init_state=state_slices(pb, {"w": {"row": np.full(3, 2.0), "col":
                                                                               np.full(4, 3.0)}}, "w")))
            self.assertEqual((r.tensors[0].ready, r.tensors[0].version, r.tensors[0].created), (True, 9, False))
            got, ver = H.pull(a.stub, {"w": [3, 4]})
            np.testing.assert_array_equal(got["w"].reshape(-1), new)
            arr, inf, _ = get_state(a.stub, ["w"])
            self.assertEqual((inf["w"].step, inf["w"].version), (9, 9))
            np.testing.assert_array_equal(arr["w"]["row"], np.full(3, 2.0, np.float32))
            np.testing.assert_array_equal(arr["w"]["col"], np.full(4, 3.0, np.float32))
            _, ts = H.stats(a.stub, log=8)
            self.assertEqual(len(ts["w"].apply_log), 0)  # a new history
            # Replace at step 0: fresh state, version 0; pushes go on from there.
            r = self.create(a.stub, self.tc("w", new, replace=True))
            self.assertEqual(r.tensors[0].version, 0)
            arr, inf, _ = get_state(a.stub, ["w"])
            self.assertEqual(inf["w"].step, 0)
            np.testing.assert_array_equal(arr["w"]["row"], np.zeros(3, np.float32))
            _, ver = H.push(a.stub, 0, 0, {"w": ([3, 4], np.ones(12, np.float32))})
            self.assertEqual(ver["w"], 1)
            # A tensor that does not exist: replace creates it.
            r = self.create(a.stub, self.tc("fresh", np.ones(2), shape=[2], opt=H.optimizer(), replace=True))
            self.assertTrue(r.tensors[0].created and r.tensors[0].ready)
        finally:
            a.stop()

    def test_ssp_resume_does_not_wait_for_step_zero(self):
        # ssp clocks start at the first push's step: workers resuming at
        # step 10 on a new shard go on, the staleness bound holds from there.
        import time
        srv = H.Server("--mode", "ssp", "--workers", 2, "--staleness", 1, "--deadline", 20)
        try:
            H.create(srv.stub, "w", [3, 4], np.zeros(12, np.float32))
            g = {"w": ([3, 4], np.ones(12, np.float32))}
            t0 = time.monotonic()
            H.push(srv.stub, 0, 10, g, timeout=20)
            H.push(srv.stub, 0, 11, g, timeout=20)
            self.assertLess(time.monotonic() - t0, 2.0)
            # Worker 0 at 12 would be 2 ahead of worker 1 (clock 10): it waits.
            self.assertStatus(lambda: H.push(srv.stub, 0, 12, g, timeout=1.0),
                              self.grpc.StatusCode.DEADLINE_EXCEEDED)
            H.push(srv.stub, 1, 10, g, timeout=20)
            H.push(srv.stub, 0, 12, g, timeout=20)
        finally:
            srv.stop()

    def test_replace_refused_while_round_open(self):
        srv = H.Server("--mode", "sync", "--workers", 2, "--deadline", 20)
        try:
            p0 = np.linspace(-1, 1, 12, dtype=np.float32)
            H.create(srv.stub, "w", [3, 4], p0)
            res = {}
            th = threading.Thread(target=lambda: res.setdefault("r", H.push(srv.stub, 0, 0, {"w": ([3, 4], np.ones(
                12, np.float32))}, timeout=20)))
            th.start()
            import time
            time.sleep(0.3)
            self.assertStatus(lambda: self.create(srv.stub, self.tc("w", np.zeros(12), replace=True)),
                              self.grpc.StatusCode.FAILED_PRECONDITION, "'w'", "sync round is open", "1 of 2")
            got, ver = H.pull(srv.stub, {"w": [3, 4]})
            np.testing.assert_array_equal(got["w"].reshape(-1), p0)
            H.push(srv.stub, 1, 0, {"w": ([3, 4], np.ones(12, np.float32))}, timeout=20)
            th.join(20)
            self.assertEqual(res["r"][1], {"w": 1})
            # Between rounds it is allowed.
            r = self.create(srv.stub, self.tc("w", np.zeros(12), replace=True))
            self.assertEqual(r.tensors[0].version, 0)
        finally:
            srv.stop()


if __name__ == "__main__":
    unittest.main()
