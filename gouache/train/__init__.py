"""Training loops for the shapes family (`gouache train vae|unet|dit`): seeded, on the CPU."""
