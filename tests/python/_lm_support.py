"""The tiny language model the Trainer and Accelerate tests train: a GPT-2
built from a config (random weights, no download; no dropout, so runs
repeat exactly) learning the bytes of two standard-library sources that ship
with every Python (byte = token, vocabulary 256)."""

import os

import torch

WINDOW = 32


def text():
    base = os.path.dirname(os.__file__)
    data = b""
    for name in ("textwrap.py", "colorsys.py"):
        with open(os.path.join(base, name), "rb") as f:
            data += f.read()
    return data


class Windows(torch.utils.data.Dataset):
    """n windows of WINDOW bytes from `offset` on, as causal-LM examples."""

    def __init__(self, data, n, offset=0):
        if offset + n * WINDOW > len(data):
            raise ValueError(f"{n} windows from {offset} need more than {len(data)} bytes")
        self.data, self.n, self.offset = data, n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        lo = self.offset + i * WINDOW
        ids = torch.tensor(list(self.data[lo:lo + WINDOW]), dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=WINDOW, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)
