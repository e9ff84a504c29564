"""Running fedapp's ClientApp on SuperNodes: `warm_exec`, a SuperExec that starts each ClientApp task as a fork
of a process holding torch, Flower and the ClientApp already imported (docs/deployment.md)."""
