"""The small model and data the optimizer tests train: one definition, so the
tests of jobs, state and resume train exactly the same thing."""

import torch


class Net(torch.nn.Module):
    def __init__(self, seed=1234):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(0.5 * torch.randn(10, 7, generator=g))
        self.b1 = torch.nn.Parameter(0.1 * torch.randn(7, generator=g))
        self.t3 = torch.nn.Parameter(0.5 * torch.randn(2, 7, 3, generator=g))
        self.s = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        h = torch.tanh(x @ self.w1 + self.b1)
        return (h @ self.t3[0] + h @ self.t3[1]) * self.s


def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(16, 10, generator=g), torch.randn(16, 3, generator=g)


def loss_step(model, opt, worker, step):
    x, y = batch(worker, step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss)


def overlap_loop(model, opt, steps, before_step=None, accumulate=1, handle=None):
    """`steps` steps of `accumulate` micro-batches each (the earlier ones
    inside handle.no_sync() when given); before_step(step) after backward."""
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(micro, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if handle is not None and micro < accumulate - 1:
                with handle.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if before_step is not None:
            before_step(step)
        opt.step()


def overlap_pair(test, shards, steps, **kw):
    """Trains one Net with attach() and one without, side by side on
    `shards`; returns (attached model, plain model, attached opt, handle)."""
    from factorps.torch import RemoteAdafactor, attach
    a, b = Net(), Net()
    oa = RemoteAdafactor(a.named_parameters(), shards=shards.addrs, namespace="a/")
    ob = RemoteAdafactor(b.named_parameters(), shards=shards.addrs, namespace="b/")
    test.addCleanup(oa.close)
    test.addCleanup(ob.close)
    h = attach(a, oa, bucket_cap_mb=1e-4)   # about one parameter per bucket
    overlap_loop(a, oa, steps, handle=h, **kw)
    overlap_loop(b, ob, steps, **{k: v for k, v in kw.items() if k != "before_step"})
    return a, b, oa, h

