// Command nemo-gym-otelcol is the OpenTelemetry Collector the tests of
// opentelemetry-instrumentation-nemo-gym run: an OTLP receiver, the batch processor, the
// Prometheus exporter (for a real Prometheus to scrape), the debug exporter, and the OTLP
// exporter that forwards traces to Jaeger (start-collector.sh --jaeger).
//
// It is shaped like the OpenTelemetry Collector Builder's output (a factory table handed to
// otelcol.NewCommand), written by hand so that the only build inputs are this file, go.mod
// and go.sum; scripts/start-collector.sh builds it with the machine's Go.
package main

import (
	"log"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/confmap/provider/yamlprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/debugexporter"
	"go.opentelemetry.io/collector/exporter/otlpexporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/processor/batchprocessor"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/prometheusexporter"
)

func components() (otelcol.Factories, error) {
	var err error
	factories := otelcol.Factories{
		// The collector's own logs and metrics, configured under service.telemetry.
		Telemetry: otelconftelemetry.NewFactory(),
	}

	factories.Receivers, err = otelcol.MakeFactoryMap[receiver.Factory](
		otlpreceiver.NewFactory(),
	)
	if err != nil {
		return otelcol.Factories{}, err
	}
	factories.Processors, err = otelcol.MakeFactoryMap[processor.Factory](
		batchprocessor.NewFactory(),
	)
	if err != nil {
		return otelcol.Factories{}, err
	}
	factories.Exporters, err = otelcol.MakeFactoryMap[exporter.Factory](
		prometheusexporter.NewFactory(),
		debugexporter.NewFactory(),
		// OTLP over gRPC: the traces to Jaeger (start-collector.sh --jaeger).
		otlpexporter.NewFactory(),
	)
	if err != nil {
		return otelcol.Factories{}, err
	}
	return factories, nil
}

func main() {
	info := component.BuildInfo{
		Command:     "nemo-gym-otelcol",
		Description: "OpenTelemetry Collector for the opentelemetry-instrumentation-nemo-gym tests",
		Version:     "0.165.0",
	}
	settings := otelcol.CollectorSettings{
		BuildInfo: info,
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(),
					fileprovider.NewFactory(),
					yamlprovider.NewFactory(),
				},
			},
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		log.Fatal(err)
	}
}
