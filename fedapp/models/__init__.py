"""fedapp's diffusion toolkit: priors (tiny or Stable Diffusion), samplers, features, small nets.

Import from the submodules (`fedapp.models.prior`, `.features`, `.classifier`, `.ddpm`, `.flow`,
`.text`), so that `import fedapp.models` stays cheap: diffusers/transformers load only when a prior or
network is used.
"""
