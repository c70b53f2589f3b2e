# Ferry's built-in policy set: development, test and staging environments.
package ferry.policy

import rego.v1

allow contains msg if {
	not production
	msg := sprintf(
		"%s environment: %s plan allowed (%d adds, %d changes, %d deletes, %d replaces)",
		[class_name, input.kind, input.adds, input.changes, input.deletes, input.replaces],
	)
}
