"""Template replay of edits (InstGenIE): the tiered store of templates' activations (`store`),
the load plan that overlaps their loading with compute (`load_plan`), replay in packed DiT
forwards (`replay`) and in UNets (`unet`)."""
