"""torch.optim adapters with bitsandbytes' class names (to come: see the project's open issues)."""
