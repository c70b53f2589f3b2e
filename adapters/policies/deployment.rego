# Ferry's built-in deployment policy: what a promotion of a release into an environment
# needs. Files in FERRY_POLICY_DIR may add reasons to any set of this package.
#
#   deny              reasons that reject the promotion at the policy gate
#   require_approval  reasons that make it wait for an approval of class production
#   allow             reasons that let it go ahead
#   hotfix            reasons that let a hotfix skip the prior environment class of the
#                     promotion path (none here: a team allows hotfixes in its own policy)
package ferry.deployment

import rego.v1

# An unknown class counts as production: nothing escapes the approval by being unknown.
production if input.environmentClass == "production"

production if not input.environmentClass

production if input.environmentClass == null

require_approval contains msg if {
	production
	not input.rollback
	msg := sprintf(
		"release %s of %s into production environment %s needs an approval of class production",
		[input.releaseVersion, input.projectId, input.environmentId],
	)
}

allow contains msg if {
	production
	input.rollback
	msg := sprintf(
		"rollback in production environment %s: the Operator who asked holds the approval by role",
		[input.environmentId],
	)
}

allow contains msg if {
	not production
	msg := sprintf(
		"release %s of %s into %s environment %s",
		[input.releaseVersion, input.projectId, input.environmentClass, input.environmentId],
	)
}
