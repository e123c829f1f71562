# QuotaClass: which quota class the caller's calls are counted under.
#
#   data.toolproxy.quota_classes.subjects[tenant][subject]   class of one caller
#   data.toolproxy.quota_classes.tenants[tenant]             class of every caller of a tenant
#
# A class is only a name: its figures live in the proxy's configuration
# (quotas.classes, e.g. reduced = "rate=2/1s burst=2"), so the security team
# picks who is throttled and the platform team sizes the budgets. A caller's
# own class wins over its tenant's. No class: the default limits apply.
# Naming a class the proxy does not define fails the call closed (forbidden).
package toolproxy.quotas

default classes := {}

classes := data.toolproxy.quota_classes

subject_class := classes.subjects[input.subject.tenant][input.subject.id]

quota_class := subject_class

quota_class := classes.tenants[input.subject.tenant] if not subject_class
