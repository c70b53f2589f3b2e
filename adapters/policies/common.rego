# Ferry's built-in policy set: shared helpers.
#
# Every policy (built-in or from the configured folder) that takes part in decisions lives
# in `package ferry.policy` and adds one-line reasons to the sets `deny`,
# `require_approval` and `allow`. Ferry combines them: any deny wins, then any
# require_approval, else allow when at least one allow reason exists.
package ferry.policy

import rego.v1

non_production_classes := {"development", "test", "staging"}

# An unknown class (null) counts as production, so that no run escapes approval because
# Ferry has not heard of its environment yet.
production if not input.environmentClass in non_production_classes

deleted_or_replaced contains r.urn if {
	some r in input.resources
	r.op in {"delete", "replace"}
}

destructive if input.deletes + input.replaces > 0

destructive if count(deleted_or_replaced) > 0

class_name := input.environmentClass if input.environmentClass != null

class_name := "unknown (treated as production)" if input.environmentClass == null
