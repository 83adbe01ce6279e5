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
