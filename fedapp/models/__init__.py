"""Models: diffusion prior, samplers and features, flow matching, DDPM, classifiers."""
