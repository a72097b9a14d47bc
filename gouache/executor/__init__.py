"""Running step plans on devices: in this process (`uniproc`), on worker processes
(`multiproc`) or Ray actors; `pool` holds which devices hold which request."""
