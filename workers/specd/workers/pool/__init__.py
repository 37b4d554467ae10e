"""The pool tier: the Ray actor that hosts an engine (`actor`), the controller that keeps
replicas alive and rolls config changes (`controller`), the replica handle (`replica`),
the reconcile plan (`plan`), the Ray calls to the actors (`supervisor`), replica choice
(`router`), autoscaling, prefix affinity and the session directory."""
