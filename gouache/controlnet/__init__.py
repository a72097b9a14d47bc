"""ControlNets (KATZ): the models and their residuals (`model`), the loaded models (`cache`), a
runner's ControlNets per forward (`runtime`: in process, sync overlapping the UNet's encoder, or
async a step late) and the ControlNet service's worker processes (`service`)."""
