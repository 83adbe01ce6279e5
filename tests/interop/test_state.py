#!/usr/bin/python3
"""The optimizer state on the wire, driven with grpcio: GetState (every
refusal with its exact status and message, state unchanged; a large state
over several messages, covered exactly; a state read at one version while
pushes run)."""
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


if __name__ == "__main__":
    unittest.main()
