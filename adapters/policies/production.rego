# Ferry's built-in policy set: production environments (and unknown classes).
package ferry.policy

import rego.v1

self_authorising_kinds := {"Baseline", "Reconciliation"}

# Deletes and replaces in production are never applied automatically, whatever else
# authorises the run.
require_approval contains msg if {
	production
	destructive
	not input.rollback
	msg := sprintf(
		"%s plan in a %s environment deletes %d and replaces %d resources: destructive production plans are never applied automatically",
		[input.kind, class_name, input.deletes, input.replaces],
	)
}

# Releases and decommissions need the promotion's approval.
require_approval contains msg if {
	production
	not input.hasPromotionApproval
	not input.rollback
	not input.kind in self_authorising_kinds
	msg := sprintf("%s apply in a %s environment needs the promotion's approval", [input.kind, class_name])
}

allow contains msg if {
	production
	not destructive
	input.hasPromotionApproval
	msg := sprintf("%s apply in a %s environment carries the promotion's approval", [input.kind, class_name])
}

# Baselines and reconciliations authorise themselves when they only add and change.
allow contains msg if {
	production
	not destructive
	not input.hasPromotionApproval
	input.kind in self_authorising_kinds
	msg := sprintf(
		"%s plan in a %s environment is non-destructive (%d adds, %d changes, no deletes or replaces)",
		[input.kind, class_name, input.adds, input.changes],
	)
}

# A rollback restores the release that ran before, under the rollback's own authority (an
# Operator's by role, or the failed verification it answers), even when it deletes what the
# failed release added. A team's own policy may still deny it.
allow contains msg if {
	production
	input.rollback
	msg := sprintf(
		"%s apply in a %s environment restores the previous release under a rollback's authority (%d adds, %d changes, %d deletes, %d replaces)",
		[input.kind, class_name, input.adds, input.changes, input.deletes, input.replaces],
	)
}
