"""mlflow's pricing: it costs the devices nothing, and says so, so that a plan counts it rather than listing it as
not counted."""

from titan_core import hookimpl


@hookimpl
def estimate_costs() -> None:
    """mlflow: nothing on the devices or in their collectives: rank 0 sends a logged step's values between steps
    (a round trip to the tracking server on logging steps, not priced: no hardware profile knows the server)."""
