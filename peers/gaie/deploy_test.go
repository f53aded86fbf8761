package gaie

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	apiextensionsinternal "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	apivalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
	"sigs.k8s.io/yaml"
)

// The manifests of deploy/k8s/gateway are checked against the CRDs the
// modules ship: GAIE v1.3.0's InferencePool CRD and the Gateway API CRDs of
// the gateway-api version GAIE requires, with the API server's own
// validation (k8s.io/apiextensions-apiserver: OpenAPI schema, unknown
// fields as pruning reports them, and the CRDs' CEL rules), and each object
// also decoded strictly into its Go type.

const gatewayDir = "../../deploy/k8s/gateway"

// crdValidator validates objects of one CRD version as the API server does
// at create.
type crdValidator struct {
	crd        string
	schema     apivalidation.SchemaCreateValidator
	structural *structuralschema.Structural
	cel        *cel.Validator
}

func moduleDir(t *testing.T, mod string) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", mod).Output()
	if err != nil {
		t.Fatalf("go list -m %s: %v", mod, err)
	}
	return strings.TrimSpace(string(out))
}

func loadCRD(t *testing.T, path, group, plural, version string) *crdValidator {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var crd apiextensionsv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(data, &crd); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if crd.Spec.Group != group || crd.Spec.Names.Plural != plural {
		t.Fatalf("%s: CRD %s.%s, want %s.%s", path, crd.Spec.Names.Plural, crd.Spec.Group, plural, group)
	}
	for _, v := range crd.Spec.Versions {
		if v.Name != version {
			continue
		}
		if !v.Served {
			t.Fatalf("%s: version %s not served", path, version)
		}
		var internal apiextensionsinternal.JSONSchemaProps
		if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v.Schema.OpenAPIV3Schema, &internal, nil); err != nil {
			t.Fatalf("%s: schema: %v", path, err)
		}
		sv, _, err := apivalidation.NewSchemaValidator(&internal)
		if err != nil {
			t.Fatalf("%s: schema validator: %v", path, err)
		}
		st, err := structuralschema.NewStructural(&internal)
		if err != nil {
			t.Fatalf("%s: structural schema: %v", path, err)
		}
		return &crdValidator{crd: filepath.Base(path), schema: sv, structural: st, cel: cel.NewValidator(st, true, celconfig.PerCallLimit)}
	}
	t.Fatalf("%s: no version %s", path, version)
	return nil
}

// validate returns every error the API server would give obj at create.
func (v *crdValidator) validate(obj map[string]any) field.ErrorList {
	errs := apivalidation.ValidateCustomResource(nil, obj, v.schema)
	copied := deepCopy(obj)
	for _, p := range pruning.PruneWithOptions(copied, v.structural, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true}) {
		errs = append(errs, field.Forbidden(field.NewPath(p), "unknown field "+p))
	}
	if v.cel != nil {
		celErrs, _ := v.cel.Validate(context.Background(), nil, v.structural, obj, nil, celconfig.RuntimeCELCostBudget)
		errs = append(errs, celErrs...)
	}
	return errs
}

func deepCopy(obj map[string]any) map[string]any {
	b, err := yaml.Marshal(obj)
	if err != nil {
		panic(err)
	}
	out, err := decodeObject(b)
	if err != nil {
		panic(err)
	}
	return out
}

// decodeObject reads YAML as the API server reads a JSON body: integers
// as int64 (CEL rules compare them as ints), not float64.
func decodeObject(y []byte) (map[string]any, error) {
	j, err := yaml.YAMLToJSON(y)
	if err != nil {
		return nil, err
	}
	var m map[string]any
	if err := utiljson.Unmarshal(j, &m); err != nil {
		return nil, err
	}
	return m, nil
}

// docs splits a manifest file into its objects, each as YAML and as a map.
func docs(t *testing.T, name string) (raw [][]byte, objs []map[string]any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(gatewayDir, name))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range bytes.Split(data, []byte("\n---\n")) {
		m, err := decodeObject(d)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(m) == 0 {
			continue
		}
		raw, objs = append(raw, d), append(objs, m)
	}
	return raw, objs
}

func TestDeployGatewayInferencePool(t *testing.T) {
	gaieDir := moduleDir(t, "sigs.k8s.io/gateway-api-inference-extension")
	v := loadCRD(t, filepath.Join(gaieDir, "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"),
		"inference.networking.k8s.io", "inferencepools", "v1")
	raw, objs := docs(t, "inferencepool.yaml")
	if len(objs) != 1 {
		t.Fatalf("inferencepool.yaml: %d objects, want 1", len(objs))
	}
	if errs := v.validate(objs[0]); len(errs) > 0 {
		t.Fatalf("inferencepool.yaml against %s: %v", v.crd, errs.ToAggregate())
	}
	var pool inferencev1.InferencePool
	if err := yaml.UnmarshalStrict(raw[0], &pool); err != nil {
		t.Fatalf("inferencepool.yaml into GAIE's v1.InferencePool: %v", err)
	}

	// The validator refuses what the API server refuses: each broken copy
	// of the manifest must fail (else the check above proves nothing).
	for _, tc := range []struct {
		name  string
		edit  func(spec map[string]any)
		error string
	}{
		{"no target ports", func(s map[string]any) { delete(s, "targetPorts") }, "targetPorts"},
		{"port out of range", func(s map[string]any) { s["targetPorts"] = []any{map[string]any{"number": 70000}} }, "number"},
		{"port twice (CEL rule)", func(s map[string]any) {
			s["targetPorts"] = []any{map[string]any{"number": 8000}, map[string]any{"number": 8000}}
		}, "unique"},
		{"unknown field", func(s map[string]any) { s["selectors"] = map[string]any{} }, "selectors"},
		{"empty selector", func(s map[string]any) { s["selector"] = map[string]any{"matchLabels": map[string]any{}} }, "matchLabels"},
		{"bad failure mode", func(s map[string]any) {
			s["endpointPickerRef"].(map[string]any)["failureMode"] = "Sometimes"
		}, "failureMode"},
	} {
		broken := deepCopy(objs[0])
		tc.edit(broken["spec"].(map[string]any))
		errs := v.validate(broken)
		if len(errs) == 0 || !strings.Contains(errs.ToAggregate().Error(), tc.error) {
			t.Errorf("%s: errors %v, want one naming %q", tc.name, errs, tc.error)
		}
	}

	// Wiring: the picker is kvrouter's ext_proc Service at its port, and
	// the pool is the one the StatefulSet patch watches.
	_, svcs := docs(t, "service-epp.yaml")
	ref := pool.Spec.EndpointPickerRef
	if ref.Kind != "Service" || string(ref.Name) != svcs[0]["metadata"].(map[string]any)["name"] || ref.Port == nil {
		t.Fatalf("endpointPickerRef %+v does not name service-epp.yaml's Service", ref)
	}
	port := fmt.Sprint(svcs[0]["spec"].(map[string]any)["ports"].([]any)[0].(map[string]any)["port"])
	if fmt.Sprint(ref.Port.Number) != port {
		t.Fatalf("endpointPickerRef port %d, Service port %s", ref.Port.Number, port)
	}
	kust, err := os.ReadFile(filepath.Join(gatewayDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--inference-pool=$(POD_NAMESPACE)/" + pool.Name, "--ext-proc-listen=0.0.0.0:" + port, "containerPort: " + port} {
		if !bytes.Contains(kust, []byte(want)) {
			t.Errorf("kustomization.yaml does not patch in %q", want)
		}
	}
}

func TestDeployGatewayAPIObjects(t *testing.T) {
	gwDir := moduleDir(t, "sigs.k8s.io/gateway-api")
	crds := map[string]*crdValidator{}
	for kind, plural := range map[string]string{"GatewayClass": "gatewayclasses", "Gateway": "gateways", "HTTPRoute": "httproutes"} {
		crds[kind] = loadCRD(t, filepath.Join(gwDir, "config/crd/standard/gateway.networking.k8s.io_"+plural+".yaml"),
			"gateway.networking.k8s.io", plural, "v1")
	}
	var route *gatewayv1.HTTPRoute
	var gateway *gatewayv1.Gateway
	seen := map[string]bool{}
	for _, file := range []string{"gateway.yaml", "httproute.yaml"} {
		raw, objs := docs(t, file)
		for i, obj := range objs {
			kind, _ := obj["kind"].(string)
			v, ok := crds[kind]
			if !ok {
				t.Fatalf("%s: unexpected kind %q", file, kind)
			}
			seen[kind] = true
			if errs := v.validate(obj); len(errs) > 0 {
				t.Errorf("%s %s against %s: %v", file, kind, v.crd, errs.ToAggregate())
			}
			var err error
			switch kind {
			case "GatewayClass":
				err = yaml.UnmarshalStrict(raw[i], &gatewayv1.GatewayClass{})
			case "Gateway":
				gateway = &gatewayv1.Gateway{}
				err = yaml.UnmarshalStrict(raw[i], gateway)
			case "HTTPRoute":
				route = &gatewayv1.HTTPRoute{}
				err = yaml.UnmarshalStrict(raw[i], route)
			}
			if err != nil {
				t.Errorf("%s %s strict: %v", file, kind, err)
			}
		}
	}
	if len(seen) != 3 || route == nil || gateway == nil {
		t.Fatalf("kinds %v: want GatewayClass, Gateway and HTTPRoute", seen)
	}
	// A broken route fails the same validation.
	_, objs := docs(t, "httproute.yaml")
	broken := deepCopy(objs[0])
	broken["spec"].(map[string]any)["rules"].([]any)[0].(map[string]any)["backendRefs"].([]any)[0].(map[string]any)["weight"] = -1
	if errs := crds["HTTPRoute"].validate(broken); len(errs) == 0 {
		t.Errorf("an HTTPRoute with weight -1 passed validation")
	}

	_, pools := docs(t, "inferencepool.yaml")
	poolName := pools[0]["metadata"].(map[string]any)["name"]
	var toPool bool
	for _, rule := range route.Spec.Rules {
		for _, b := range rule.BackendRefs {
			if b.Group != nil && *b.Group == "inference.networking.k8s.io" && b.Kind != nil && *b.Kind == "InferencePool" && string(b.Name) == poolName {
				toPool = true
			}
		}
	}
	if !toPool {
		t.Errorf("httproute.yaml has no backendRef to InferencePool %v", poolName)
	}
	if len(route.Spec.ParentRefs) != 1 || string(route.Spec.ParentRefs[0].Name) != gateway.Name {
		t.Errorf("httproute.yaml's parentRefs %v do not name Gateway %s", route.Spec.ParentRefs, gateway.Name)
	}
}

// TestDeployGatewayRBAC: kvrouter's Role lets it read exactly what the
// informers read.
func TestDeployGatewayRBAC(t *testing.T) {
	_, objs := docs(t, "rbac.yaml")
	var rules []any
	for _, o := range objs {
		if o["kind"] == "Role" {
			rules = o["rules"].([]any)
		}
	}
	want := map[string]string{"inferencepools": "inference.networking.k8s.io", "pods": ""}
	for res, group := range want {
		found := false
		for _, r := range rules {
			rm := r.(map[string]any)
			if slices.Contains(rm["apiGroups"].([]any), any(group)) && slices.Contains(rm["resources"].([]any), any(res)) {
				verbs := rm["verbs"].([]any)
				found = slices.Contains(verbs, any("get")) && slices.Contains(verbs, any("list")) && slices.Contains(verbs, any("watch"))
			}
		}
		if !found {
			t.Errorf("rbac.yaml: no get/list/watch on %s (group %q)", res, group)
		}
	}
}
