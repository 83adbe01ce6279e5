#!/usr/bin/python3
"""factorps-server driven by a grpcio client generated from the .proto at
test time: create, push, pull, stats in every mode, bf16 on the wire, the
sync average checked against numpy and against a one-worker replay through
the server's own kernel, shutdown with calls in flight."""
import threading
import time
import unittest

import numpy as np

import fpsharness as H


class Interop(unittest.TestCase):
    def test_create_push_pull_stats(self):
        pb, _, grpc = H.stubs()
        srv = H.Server("--mode", "async", "--shard-id", "1", "--shard-count", "2")
        try:
            self.assertIn("listening on 127.0.0.1:%d" % srv.port, srv.line)
            rng = np.random.default_rng(1)
            p0 = (0.5 * rng.standard_normal((64, 33))).astype(np.float32)
            r = H.create(srv.stub, "layer.w", [64, 33], p0, shard_id=1, shard_count=2)
            self.assertEqual(len(r.tensors), 1)
            info = r.tensors[0]
            self.assertTrue(info.ready and info.created)
            self.assertEqual((info.version, info.initialised_elements), (0, 64 * 33))
            # Idempotent: same settings succeed and report the version.
            r = H.create(srv.stub, "layer.w", [64, 33], shard_id=1, shard_count=2)
            self.assertFalse(r.tensors[0].created)
            self.assertTrue(r.tensors[0].ready)

            got, ver = H.pull(srv.stub, {"layer.w": [64, 33]})
            np.testing.assert_array_equal(got["layer.w"], p0)
            self.assertEqual(ver, {"layer.w": 0})

            g = rng.standard_normal((64, 33)).astype(np.float32)
            got, ver = H.push(srv.stub, 7, 0, {"layer.w": ([64, 33], g)})
            self.assertEqual(ver, {"layer.w": 1})
            row, col = np.zeros(64), np.zeros(33)
            want = H.torch_adafactor_step(p0, g, row, col, None, 1)
            np.testing.assert_allclose(got["layer.w"], want, rtol=0, atol=1e-6 * np.abs(want).max())
            got2, ver2 = H.pull(srv.stub, {"layer.w": [64, 33]})
            np.testing.assert_array_equal(got2["layer.w"], got["layer.w"])

            # skip_params: versions only.
            resp = list(srv.stub.PushPull(H.grad_messages(7, 1, {"layer.w": ([64, 33], g)}, skip_params=True),
                                          timeout=30))
            self.assertEqual(sum(len(x.params) for x in resp), 0)
            self.assertEqual(resp[-1].versions[0].version, 2)

            s, ts = H.stats(srv.stub, log=10)
            self.assertEqual((s.shard.shard_id, s.shard.shard_count), (1, 2))
            self.assertEqual(s.shard.mode, pb.MODE_ASYNC)
            self.assertEqual(s.shard.tensors, 1)
            self.assertEqual(s.shard.param_elements, 64 * 33)
            self.assertEqual(s.shard.pushes, 2)
            self.assertEqual(s.shard.updates, 2)
            self.assertIn(s.shard.simd, ("scalar", "avx2", "avx512", "neon"))
            t = ts["layer.w"]
            self.assertEqual((t.version, t.ready, t.factored), (2, True, True))
            self.assertEqual(list(t.shape), [64, 33])
            self.assertEqual((t.state.row_elements, t.state.col_elements, t.state.elements), (64, 33, 97))
            self.assertEqual(t.state.adamw_elements, 2 * 64 * 33)
            self.assertEqual([(a.worker_id, a.step, a.version) for a in t.apply_log], [(7, 0, 1), (7, 1, 2)])
            self.assertGreater(s.shard.bytes_received, 2 * 64 * 33 * 4)
        finally:
            srv.stop()

    def test_flags_env_and_help(self):
        import os
        import subprocess
        run = lambda args, env=None: subprocess.run([H.SERVER] + args, capture_output=True, text=True, timeout=60,
                                                    env=dict(os.environ, **(env or {})))
        r = run(["--help"])
        self.assertEqual(r.returncode, 0)
        for flag in ("--listen", "--shard-id", "--shard-count", "--mode", "--staleness", "--workers", "--deadline",
                     "--max-message-bytes", "--threads", "--port-file", "--max-tensors", "--max-bytes",
                     "FACTORPS_MODE"):
            self.assertIn(flag, r.stdout)
        for args, env, words in ((["--bogus"], None, "'--bogus'"), (["--mode", "nope"], None, "sync, async or ssp"),
                                 (["--shard-id", "2", "--shard-count", "2"], None, "below --shard-count"),
                                 ([], {"FACTORPS_WORKERS": "x"}, "FACTORPS_WORKERS"),
                                 (["--deadline", "-1"], None, "--deadline")):
            r = run(args, env)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            self.assertIn(words, r.stderr)
        # Environment values apply; a flag wins over them.
        srv = H.Server("--workers", 3, env={"FACTORPS_MODE": "ssp", "FACTORPS_WORKERS": "5"})
        try:
            pb, _, _ = H.stubs()
            s, _ = H.stats(srv.stub)
            self.assertEqual((s.shard.mode, s.shard.workers), (pb.MODE_SSP, 3))
            # A port in use is an error, not a silently shared port.
            r = run(["--listen", srv.addr])
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("cannot listen on '%s'" % srv.addr, r.stderr)
            for m in H.SANITIZER_MARKERS:
                self.assertNotIn(m, r.stderr)
        finally:
            srv.stop()

    def test_unknown_method_unimplemented(self):
        _, _, grpc = H.stubs()
        srv = H.Server()
        try:
            ch = srv.channel()
            call = ch.unary_unary("/factorps.v1.ParameterServer/Nope")
            with self.assertRaises(grpc.RpcError) as cm:
                call(b"", timeout=10)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
            ch.close()
        finally:
            srv.stop()

    def test_bf16_wire(self):
        pb, _, _ = H.stubs()
        srv = H.Server("--mode", "async")
        try:
            p0 = np.linspace(-1, 1, 1000, dtype=np.float32)
            H.create(srv.stub, "b", [1000], p0)
            got, _ = H.pull(srv.stub, {"b": [1000]}, dtype=pb.DTYPE_BF16)
            np.testing.assert_array_equal(got["b"], H.from_bf16(H.to_bf16(p0)))
            g = np.linspace(1, 2, 1000, dtype=np.float32)
            got, ver = H.push(srv.stub, 0, 0, {"b": ([1000], g)}, dtype=pb.DTYPE_BF16)
            self.assertEqual(ver["b"], 1)
            exact, _ = H.pull(srv.stub, {"b": [1000]})
            # The reply uses the push's dtype: bf16 of the fp32 params.
            np.testing.assert_array_equal(got["b"], H.from_bf16(H.to_bf16(exact["b"])))
            var = np.zeros(1000)
            want = H.torch_adafactor_step(p0, H.from_bf16(H.to_bf16(g)), None, None, var, 1)
            np.testing.assert_allclose(exact["b"], want, atol=1e-6)
        finally:
            srv.stop()

    def test_sync_bf16_replies_identical(self):
        """A sync round's bf16 replies (one shared encoding per snapshot on
        the shard) are bit-identical for all W workers and equal to the
        bf16 of the fp32 parameters, also across reply messages: "big" needs
        two messages of bf16, "small" shares the first one. The encoding is
        made by the update's pass C in blocks: "wide" rows and "vec" span
        several blocks. Step 1 mixes bf16 and fp32 workers: the fp32 ones
        get the exact parameters."""
        pb, _, _ = H.stubs()
        W, steps = 4, 2
        shapes = {"big": [1536, 1500], "small": [7, 9], "wide": [3, 10001], "vec": [20003]}
        srv = H.Server("--mode", "sync", "--workers", W, "--deadline", 60)
        try:
            rng = np.random.default_rng(11)
            for name, shape in shapes.items():
                H.create(srv.stub, name, shape, (0.5 * rng.standard_normal(shape)).astype(np.float32))
            for k in range(steps):
                grads = [{n: (s, rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()}
                         for _ in range(W)]
                got, errors = [None] * W, []

                def dtype(w):
                    return pb.DTYPE_F32 if k == 1 and w % 2 else pb.DTYPE_BF16

                def worker(w):
                    try:
                        got[w] = H.push(srv.stub, w, k, grads[w], dtype=dtype(w))
                    except Exception as e:  # reported by the main thread
                        errors.append(e)

                ths = [threading.Thread(target=worker, args=(w,)) for w in range(W)]
                for t in ths:
                    t.start()
                for t in ths:
                    t.join(120)
                self.assertFalse(errors, errors)
                exact, ver = H.pull(srv.stub, shapes)
                self.assertEqual(ver, {n: k + 1 for n in shapes})
                for name in shapes:
                    want = H.to_bf16(exact[name])
                    for w in range(W):
                        self.assertEqual(got[w][1], {n: k + 1 for n in shapes})
                        if dtype(w) == pb.DTYPE_F32:
                            np.testing.assert_array_equal(got[w][0][name], exact[name],
                                                          err_msg="step %d worker %d %s" % (k, w, name))
                            continue
                        np.testing.assert_array_equal(H.to_bf16(got[w][0][name]), want,
                                                      err_msg="step %d worker %d %s" % (k, w, name))
        finally:
            srv.stop()

    def _sync_run(self, workers, steps, shape, order_seed):
        """W workers push `steps` steps concurrently (arrival order shuffled).
        Returns the params each worker got back, per step, and the grads."""
        srv = H.Server("--mode", "sync", "--workers", workers, "--deadline", 30)
        try:
            rng = np.random.default_rng(5)
            p0 = (0.5 * rng.standard_normal(shape)).astype(np.float32)
            H.create(srv.stub, "s", list(shape), p0)
            grads = rng.standard_normal((steps, workers) + tuple(shape)).astype(np.float32)
            results = [[None] * workers for _ in range(steps)]
            errors = []
            order = np.random.default_rng(order_seed)

            def worker(w):
                try:
                    stub = srv.stub
                    for k in range(steps):
                        time.sleep(float(order.random()) * 0.02)
                        got, ver = H.push(stub, w, k, {"s": (list(shape), grads[k, w])}, slice_elems=1000)
                        assert ver == {"s": k + 1}, ver
                        results[k][w] = got["s"]
                except Exception as e:  # reported by the main thread
                    errors.append(e)

            ths = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
            for t in ths:
                t.start()
            for t in ths:
                t.join(120)
            self.assertFalse(errors, errors)
            s, ts = H.stats(srv.stub, log=100)
            self.assertEqual(ts["s"].version, steps)
            self.assertEqual(s.shard.updates, steps)
            self.assertEqual(s.shard.pushes, steps * workers)
        finally:
            srv.stop()
        return p0, grads, results

    def test_sync_three_workers(self):
        shape = (40, 70)
        steps, W = 4, 3
        p0, grads, results = self._sync_run(W, steps, shape, order_seed=1)
        for k in range(steps):
            for w in range(1, W):
                np.testing.assert_array_equal(results[k][w], results[k][0])
        # numpy replay of the averaged gradients, within float tolerance.
        p = p0.astype(np.float64)
        row, col = np.zeros(shape[0]), np.zeros(shape[1])
        for k in range(steps):
            avg = ((grads[k, 0] + grads[k, 1]) + grads[k, 2]) / np.float32(3)
            p = H.torch_adafactor_step(p.astype(np.float32), avg, row, col, None, k + 1)
            np.testing.assert_allclose(results[k][0], p, rtol=0, atol=2e-6 * np.abs(p).max())

        # Bit-exact: a one-worker shard fed the fp32 average in worker-id
        # order gives the very same bits (same kernel, same arithmetic).
        srv = H.Server("--mode", "sync", "--workers", 1)
        try:
            H.create(srv.stub, "s", list(shape), p0)
            for k in range(steps):
                avg = ((grads[k, 0] + grads[k, 1]) + grads[k, 2]) / np.float32(3)
                self.assertEqual(avg.dtype, np.float32)
                got, _ = H.push(srv.stub, 0, k, {"s": (list(shape), avg)})
                np.testing.assert_array_equal(got["s"], results[k][0])
        finally:
            srv.stop()

    def test_sync_arrival_order_does_not_matter(self):
        _, _, a = self._sync_run(3, 2, (9, 11), order_seed=2)
        _, _, b = self._sync_run(3, 2, (9, 11), order_seed=3)
        for k in range(2):
            np.testing.assert_array_equal(a[k][0], b[k][0])

    def test_sync_stress_many_tensors(self):
        # 4 workers x 12 tensors in one call each, 15 steps, while a noisy
        # client reads with Pull and Stats, sends pushes that are refused
        # (ahead of shard) and cancels streams halfway: every worker must see
        # the same parameters, equal to a one-worker replay. A cancelled
        # stream posing as worker 2 whose gradient was already summed aborts
        # its round (UNAVAILABLE, nothing applied), so the workers retry on
        # UNAVAILABLE as libfactorps does.
        _, _, grpc = H.stubs()
        W, T, steps = 4, 12, 15
        shapes = {"t%02d" % i: [3 + i, 5 + 2 * i] if i % 3 else [7 + i] for i in range(T)}
        rng = np.random.default_rng(21)
        p0 = {n: (0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
        grads = {(k, w, n): rng.standard_normal(s).astype(np.float32)
                 for k in range(steps) for w in range(W) for n, s in shapes.items()}
        srv = H.Server("--mode", "sync", "--workers", W, "--deadline", 60)
        try:
            for n, s in shapes.items():
                H.create(srv.stub, n, s, p0[n])
            results, errors, stop = {}, [], [False]

            def worker(w):
                try:
                    stub = srv.stub
                    order = np.random.default_rng(w)
                    for k in range(steps):
                        names = list(shapes)
                        order.shuffle(names)
                        for attempt in range(200):
                            try:
                                got, ver = H.push(stub, w, k, {n: (shapes[n], grads[(k, w, n)]) for n in names},
                                                  slice_elems=17, timeout=60)
                                break
                            except grpc.RpcError as e:
                                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == 199:
                                    raise
                                time.sleep(0.01)
                        assert set(ver.values()) == {k + 1}, ver
                        results[(k, w)] = got
                except Exception as e:
                    errors.append(e)

            def noise():
                stub = srv.stub
                n0 = list(shapes)[0]
                while not stop[0]:
                    H.pull(stub, {n: shapes[n] for n in list(shapes)[:3]})
                    H.stats(stub, log=5)
                    try:
                        H.push(stub, 1, 10 ** 6, {n0: (shapes[n0], np.ones(shapes[n0], np.float32))}, timeout=5)
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
                    hold = threading.Event()

                    def half():
                        yield from H.grad_messages(2, 0, {n0: (shapes[n0], np.ones(shapes[n0], np.float32))},
                                                   slice_elems=4)
                        # Never half-close before the cancel below: a stream
                        # that half-closed would be a real push of worker 2's
                        # step 0 (the workers' own pushes would then be
                        # duplicates). A timeout here let a starved thread do
                        # exactly that on a loaded machine.
                        hold.wait()
                    call = stub.PushPull(half(), timeout=5)
                    try:
                        time.sleep(0.005)
                        call.cancel()
                    finally:
                        hold.set()
                    time.sleep(0.005)

            ths = [threading.Thread(target=worker, args=(w,)) for w in range(W)]
            nz = threading.Thread(target=noise)
            nz.start()
            for t in ths:
                t.start()
            for t in ths:
                t.join(240)
            stop[0] = True
            nz.join(30)
            self.assertFalse(errors, errors)
        finally:
            srv.stop()
        for k in range(steps):
            for w in range(1, W):
                for n in shapes:
                    np.testing.assert_array_equal(results[(k, w)][n], results[(k, 0)][n])
        ref = H.Server("--mode", "sync", "--workers", 1)
        try:
            for n, s in shapes.items():
                H.create(ref.stub, n, s, p0[n])
            for k in range(steps):
                avg = {}
                for n in shapes:
                    acc = grads[(k, 0, n)].copy()
                    for w in range(1, W):
                        acc = acc + grads[(k, w, n)]
                    avg[n] = (shapes[n], acc / np.float32(W))
                got, _ = H.push(ref.stub, 0, k, avg)
                for n in shapes:
                    np.testing.assert_array_equal(got[n], results[(k, 0)][n])
        finally:
            ref.stop()

    def test_async_apply_log_replay(self):
        srv = H.Server("--mode", "async")
        try:
            rng = np.random.default_rng(9)
            p0 = (0.5 * rng.standard_normal(50)).astype(np.float32)
            H.create(srv.stub, "a", [50], p0)
            grads = {}
            errors = []

            def worker(w):
                try:
                    stub = srv.stub
                    for k in range(5):
                        g = rng.standard_normal(50).astype(np.float32)
                        grads[(w, k)] = g
                        H.push(stub, w, k, {"a": ([50], g)})
                except Exception as e:
                    errors.append(e)

            ths = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
            for t in ths:
                t.start()
            for t in ths:
                t.join(60)
            self.assertFalse(errors, errors)
            _, ts = H.stats(srv.stub, log=100)
            log = [(a.worker_id, a.step) for a in ts["a"].apply_log]
            self.assertEqual(sorted(log), sorted(grads))
            p = p0.astype(np.float64)
            var = np.zeros(50)
            for i, key in enumerate(log):
                p = H.torch_adafactor_step(p.astype(np.float32), grads[key], None, None, var, i + 1)
            got, ver = H.pull(srv.stub, {"a": [50]})
            self.assertEqual(ver["a"], 15)
            np.testing.assert_allclose(got["a"], p, atol=1e-5)
        finally:
            srv.stop()

    def test_reply_fits_default_limit(self):
        # Replies are cut to fit gRPC's default 4 MiB receive limit, versions
        # included, so a client that never raised its limit works.
        pb, pbg, grpc = H.stubs()
        srv = H.Server("--mode", "async")
        try:
            names = ["t%04d.%s" % (i, "n" * 240) for i in range(3500)]
            req = pb.CreateRequest(shard_id=0, shard_count=1, tensors=[
                pb.TensorCreate(name=n, shape=[500], optimizer=H.optimizer(),
                                init=pb.TensorSlice(dtype=pb.DTYPE_F32, data=np.zeros(500, np.float32).tobytes()))
                for n in names])
            srv.stub.Create(req, timeout=60)
            ch = grpc.insecure_channel(srv.addr)  # default limits
            stub = pbg.ParameterServerStub(ch)
            grads = {n: ([500], np.full(500, 0.5, np.float32)) for n in names}
            msgs = list(H.grad_messages(0, 0, grads))
            resp = list(stub.PushPull(iter(msgs), timeout=60))
            self.assertGreater(len(resp), 1)
            self.assertTrue(all(r.ByteSize() <= 4 * H.MiB for r in resp))
            got, ver = H.collect(resp, {n: [500] for n in names})
            self.assertEqual(len(got), 3500)
            self.assertEqual(set(ver.values()), {1})
            got, ver = H.collect(stub.Pull(pb.PullRequest(names=names), timeout=60), {n: [500] for n in names})
            self.assertEqual(len(got), 3500)
            ch.close()
        finally:
            srv.stop()

    def test_apply_log_ring(self):
        # The log grows on demand up to --apply-log, then keeps the newest.
        srv = H.Server("--mode", "async", "--apply-log", 40)
        try:
            H.create(srv.stub, "a", [3], np.zeros(3, np.float32))
            for k in range(100):
                H.push(srv.stub, k % 3, k, {"a": ([3], np.ones(3, np.float32))})
            _, ts = H.stats(srv.stub, log=1000)
            self.assertEqual([(a.worker_id, a.step, a.version) for a in ts["a"].apply_log],
                             [(k % 3, k, k + 1) for k in range(60, 100)])
            _, ts = H.stats(srv.stub, log=5)
            self.assertEqual([a.step for a in ts["a"].apply_log], [95, 96, 97, 98, 99])
            _, ts = H.stats(srv.stub, log=0)
            self.assertEqual(len(ts["a"].apply_log), 0)
        finally:
            srv.stop()

    def test_ssp_bounds_staleness(self):
        pb, _, grpc = H.stubs()
        srv = H.Server("--mode", "ssp", "--workers", 2, "--staleness", 1, "--deadline", 30)
        try:
            H.create(srv.stub, "q", [4], np.ones(4, np.float32))
            g = {"q": ([4], np.ones(4, np.float32))}
            H.push(srv.stub, 0, 0, g)
            H.push(srv.stub, 0, 1, g)  # one ahead of worker 1: allowed
            # Two ahead: waits until worker 1 catches up, bounded by the deadline.
            with self.assertRaises(grpc.RpcError) as cm:
                H.push(srv.stub, 0, 2, g, timeout=1.5)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
            done = {}

            def ahead():
                done["r"] = H.push(srv.stub, 0, 2, g, timeout=30)

            th = threading.Thread(target=ahead)
            th.start()
            time.sleep(0.5)
            self.assertNotIn("r", done)  # still waiting
            H.push(srv.stub, 1, 0, g)    # worker 1 catches up: releases it
            th.join(30)
            self.assertIn("r", done)
            _, ts = H.stats(srv.stub, log=10)
            self.assertEqual([(a.worker_id, a.step) for a in ts["q"].apply_log], [(0, 0), (0, 1), (1, 0), (0, 2)])
        finally:
            srv.stop()

    def test_kernel_threads_bit_identical(self):
        # Above FPS_POOL_MIN_NUMEL (4M elements) updates run on the kernel
        # pool; the result must not depend on the thread count.
        shape = [2048, 2049]
        rng = np.random.default_rng(11)
        p0 = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
        out = []
        for threads in (1, 3):
            srv = H.Server("--mode", "async", "--kernel-threads", threads)
            try:
                H.create(srv.stub, "k", shape, p0)
                for step, g in enumerate(grads):
                    got, _ = H.push(srv.stub, 0, step, {"k": (shape, g)})
                out.append(got["k"])
            finally:
                srv.stop()
        np.testing.assert_array_equal(out[0], out[1])

    def test_sigterm_with_parked_call(self):
        _, _, grpc = H.stubs()
        srv = H.Server("--mode", "sync", "--workers", 2)
        H.create(srv.stub, "z", [3], np.zeros(3, np.float32))
        err = {}

        def parked():
            try:
                H.push(srv.stub, 0, 0, {"z": ([3], np.ones(3, np.float32))}, timeout=30)
            except grpc.RpcError as e:
                err["code"] = e.code()

        th = threading.Thread(target=parked)
        th.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.stop(timeout=20)
        th.join(10)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertIn(err.get("code"), (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED))


if __name__ == "__main__":
    unittest.main()
