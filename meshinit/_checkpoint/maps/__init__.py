"""Framework names: ``names=`` tables, MaxText's and tunix's checkpoint maps followed
on stand-ins, and the stored tensors no path claims."""
