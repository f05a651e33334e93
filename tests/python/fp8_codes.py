"""The fp8 tensors of the compat tests compared by their codes: the byte of
each element, and the distance between two tensors in steps of the format.
"""
import torch


def codes(t):
    return t.view(torch.uint8)


def fp8_apart(a, b):
    """The largest distance between two fp8 tensors in steps of the format
    (codes of one sign are ordered by magnitude); a NaN against a number,
    or two nonzero values of opposite signs, count as far apart."""
    if a.numel() == 0:
        return 0
    ua, ub = codes(a).long(), codes(b).long()
    ma, mb = ua & 0x7F, ub & 0x7F
    same_sign = ((ua >> 7) == (ub >> 7)) | (ma == 0) | (mb == 0)
    apart = torch.where(same_sign, (ma - mb).abs(), ma + mb)
    apart = torch.where(a.float().isnan() != b.float().isnan(), torch.full_like(apart, 1000), apart)
    return int(apart.max())
