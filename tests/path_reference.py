"""A float64 transcription of the chunked PaTH attention that fla-org/flash-linear-attention's
tests check their kernel against (`tests/ops/test_path_attn.py::naive_path_attn`), shared by the
attention tests and the layer tests."""

import numpy as np


def naive_chunked(q, k, v, w, beta, g, scale, BT):
    """float64 transcription of fla's `naive_path_attn` (its tests' reference): [B, T, HQ, D]."""
    HQ, Hk = q.shape[2], k.shape[2]
    G = HQ // Hk

    def heads(x, rep):  # [B, T, h, ...] -> [B, h * rep, T, ...]
        x = np.moveaxis(x, 2, 1)
        return np.repeat(x, rep, axis=1)

    q, k, v, w = heads(q, 1), heads(k, G), heads(v, G), heads(w, G)
    beta = np.repeat(np.moveaxis(beta, 2, 1), G, axis=1)
    g_cum = np.cumsum(np.moveaxis(g, 2, 1), axis=-1)  # (B, HQ, T)
    b, h, length, d = q.shape
    pad = -length % BT
    q, k, w = (np.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, w))
    beta = np.pad(beta, ((0, 0), (0, 0), (0, pad)))
    L = q.shape[2]
    n = L // BT
    wb = w * beta[..., None]

    def chunks(x):
        return x.reshape(b, h, n, BT, d)

    q, k, w, wb = chunks(q), chunks(k), chunks(w), chunks(wb)
    upper = np.triu(np.ones((BT, BT), bool))  # on and above the diagonal
    T_ = -np.where(upper, 0.0, wb @ np.swapaxes(w, -1, -2))
    for i in range(1, BT):
        T_[..., i, :i] = T_[..., i, :i] + (T_[..., i, :, None] * T_[..., :, :i]).sum(-2)
    T_ = T_ + np.eye(BT)
    Twbk = T_ @ np.where(upper, 0.0, wb @ np.swapaxes(k, -1, -2))
    qw = np.tril(q @ np.swapaxes(w, -1, -2))
    Twb = T_ @ wb
    A_local = np.tril(q @ np.swapaxes(k, -1, -2)) - qw @ Twbk
    q = q - qw @ Twb
    k = k - np.swapaxes(Twbk, -1, -2) @ w
    Hc = np.swapaxes(w, -1, -2) @ Twb  # (b, h, n, d, d)
    A = np.zeros((b, h, L, L))
    q, k = q.reshape(b, h, L, d), k.reshape(b, h, L, d)
    for i in range(0, L, BT):
        q_i = q[:, :, i : i + BT].copy()
        for j in range(i - BT, -BT, -BT):
            A[:, :, i : i + BT, j : j + BT] = q_i @ np.swapaxes(k[:, :, j : j + BT], -1, -2)
            q_i = q_i - q_i @ Hc[:, :, j // BT]
    for c in range(n):
        A[:, :, c * BT : (c + 1) * BT, c * BT : (c + 1) * BT] = A_local[:, :, c]
    A = np.where(np.tril(np.ones((L, L), bool)), A, -np.inf)[:, :, :length, :length]
    A = A + g_cum[..., None] - g_cum[..., None, :]
    A = A * scale
    A = np.exp(A - A.max(-1, keepdims=True))
    A = A / A.sum(-1, keepdims=True)
    return np.moveaxis(A @ v, 1, 2)  # (B, T, HQ, D)
