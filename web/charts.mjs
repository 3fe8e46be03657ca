// The parts of Apache ECharts mlscale ui draws with (tree-shaken by esbuild into one minified file).
import * as echarts from "echarts/core";
import { LineChart, BarChart, HeatmapChart } from "echarts/charts";
import {
  GridComponent, TooltipComponent, LegendComponent, DataZoomComponent, VisualMapComponent,
  MarkLineComponent, MarkAreaComponent, TitleComponent, ToolboxComponent,
} from "echarts/components";
import { CanvasRenderer } from "echarts/renderers";

echarts.use([
  LineChart, BarChart, HeatmapChart, GridComponent, TooltipComponent, LegendComponent, DataZoomComponent,
  VisualMapComponent, MarkLineComponent, MarkAreaComponent, TitleComponent, ToolboxComponent, CanvasRenderer,
]);

export const { init, getInstanceByDom, use, graphic, version } = echarts;
